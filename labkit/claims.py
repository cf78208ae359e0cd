"""The figures the course texts quote (the five the course is built from), held here once, and a verdict on
a figure that a notebook measured or worked out: inside the quoted range or not, or for a single figure
whether it agrees. A notebook prints the quote beside its own figure, so that a student sees which of the
figures they read hold on their machine and which were slips. The texts' words stay in the texts: each
quote keeps only its figure and what it is a figure of."""
import math
from dataclasses import dataclass

TEXTS = {"chapter": "the textbook chapter", "summary": "the summary", "guide": "the study guide",
         "survey": "the survey section", "blog": "the blog post"}
_SCALE = {"x": 1.0, "%": 1.0, "GB": 1e9, "MB": 1e6, "ms": 1e-3}  # what one unit is, in the value's own units
_BINARY = {"GB": float(1 << 30), "MB": float(1 << 20)}  # texts often write GB where they computed GiB
AGREES = 0.05  # a single figure agrees with a value that differs from it by at most 5%


@dataclass(frozen=True)
class Quote:
    """``texts`` (keys of TEXTS) quote ``low`` to ``high`` ``unit`` (``high`` None: the single figure
    ``low``; math.inf: at least ``low``) for ``what``; ``gib``: the texts' arithmetic shows that their GB or
    MB may be GiB or MiB."""
    texts: tuple[str, ...]
    what: str
    low: float
    high: float | None = None
    unit: str = "x"
    gib: bool = False

    def __post_init__(self) -> None:
        unknown = [text for text in self.texts if text not in TEXTS]
        if unknown or not self.texts:
            raise ValueError(f"texts={self.texts!r}: each must be one of the course texts, {', '.join(TEXTS)}")
        if self.unit not in _SCALE:
            raise ValueError(f"unit={self.unit!r} is not one of {', '.join(_SCALE)}")
        if self.high is not None and not self.low <= self.high:
            raise ValueError(f"the range {self.low} to {self.high} is empty")
        if self.gib and (self.unit not in _BINARY or self.high is not None):
            raise ValueError(f"gib=True needs a single figure in {' or '.join(_BINARY)}")

    def figure(self) -> str:
        """The quoted figure as the text gives it: '2-3x', '5.2 GB', '100+ GB'."""
        space = "" if self.unit in ("x", "%") else " "
        if self.high is None:
            return f"{self.low:g}{space}{self.unit}"
        if math.isinf(self.high):
            return f"{self.low:g}+{space}{self.unit}"
        return f"{self.low:g}-{self.high:g}{space}{self.unit}"

    def reading(self, value: float) -> tuple[float, str]:
        """``value`` (a ratio, a percentage, bytes or seconds) in the quote's unit, and that unit; for a
        single figure whose GB or MB may be GiB or MiB (``gib``), in those instead where only that reading
        agrees with the quote."""
        shown = value / _SCALE[self.unit]
        if self.gib and not self._agrees(shown):
            binary = value / _BINARY[self.unit]
            if self._agrees(binary):
                return binary, self.unit[0] + "iB"
        return shown, self.unit

    def _agrees(self, shown: float) -> bool:
        return abs(shown / self.low - 1) <= AGREES

    def verdict(self, value: float) -> str:
        """Where ``value`` falls against the quote: inside, below or above its range; for a single
        figure, agrees (within AGREES) or how far off."""
        shown, unit = self.reading(value)
        if self.high is not None:
            return ("inside its range" if self.low <= shown <= self.high
                    else "below its range" if shown < self.low else "above its range")
        how = f", taking its {self.unit} as {unit}" if unit != self.unit else ""
        if self._agrees(shown):
            return f"agrees{how}"
        ratio = shown / self.low
        if 0.5 < ratio < 2:
            return f"{abs(ratio - 1):.0%} {'above' if ratio > 1 else 'below'} it{how}"
        if ratio <= 0:  # a change of the opposite sign, or none: no multiple of the quote
            return "below it" if self.low > 0 else "above it"
        return f"{ratio:.3g} times it{how}"


def _show(number: float, unit: str) -> str:
    return f"{number:.3g}{unit}" if unit in ("x", "%") else f"{number:.3g} {unit}"


QUOTES = {
    # notebook 02: the KV cache's bytes
    "kv_70b_gqa_2k": Quote(("chapter",), "one 2,048-token fp16 sequence of Llama-2 70B with its 8 KV heads", 0.67,
                           unit="GB"),
    "kv_70b_mha_2k": Quote(("chapter",), "the same sequence with 64 KV heads (MHA)", 5.2, unit="GB"),
    "kv_70b_4k": Quote(("summary",), "one 4K-token request of a 70B Llama, by a formula with every head", 2.5,
                       unit="GB"),
    "kv_8b_4k": Quote(("guide",), "one 4K-token bf16 sequence of Llama-3 8B", 512, unit="MB", gib=True),
    "kv_8b_128k": Quote(("guide",), "the same at 128K tokens, in its prose", 16, unit="GB", gib=True),
    "kv_8b_128k_code": Quote(("guide",), "the same at 128K tokens, in its code's printed output", 2.0,
                            unit="GB", gib=True),
    "kv_70b_128k": Quote(("survey",), "a 70B model's cache at 128K tokens, more than its weights", 100, math.inf,
                         unit="GB"),
    "gqa_saves": Quote(("summary",), "what GQA cuts the cache by", 4),
    "mqa_saves": Quote(("summary",), "what MQA cuts the cache by", 8),
    # notebook 04: continuous against static batching
    "batching_throughput": Quote(("summary", "blog"), "continuous batching's throughput over static batching's", 10, 20),
    "batching_throughput_guide": Quote(("guide",), "the same", 5, 10),
    "batching_latency": Quote(("chapter",), "continuous batching's cut in average latency", 2, 10),
    "static_utilization": Quote(("guide",), "the GPU's utilization under static batching", 30, 50, "%"),
    # notebook 05: speculative decoding
    "speculation_speedup": Quote(("chapter", "summary", "guide"), "speculative decoding's speed-up", 2, 3),
    "speculation_at_60_80": Quote(("chapter", "survey"), "the speed-up at acceptance rates of 60-80%", 2, 3),
    "draft_faster": Quote(("chapter",), "how many times faster the draft model's step is than the target's", 10),
    # notebook 06: weight quantization's bytes and quality
    "int8_memory": Quote(("chapter",), "INT8's cut in weight memory", 2),
    "int4_memory": Quote(("chapter",), "INT4's cut in weight memory", 4),
    "int4_70b": Quote(("chapter", "blog"), "Llama-2 70B's weights in INT4", 35, unit="GB"),
    "int8_quality": Quote(("blog",), "INT8's loss of quality", 1, unit="%"),
    "int4_quality": Quote(("chapter",), "INT4's rise in perplexity with GPTQ or AWQ", 1, 2, "%"),
    "gptq_quality": Quote(("blog",), "GPTQ's loss of quality at 4 bits", 2, 5, "%"),
}


def said(key: str) -> str:
    """The quote as a sentence: which text, its figure, and what it is a figure of."""
    quote = QUOTES[key]
    names = [TEXTS[text] for text in quote.texts]
    who = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    return f"{who[0].upper()}{who[1:]}: {quote.figure()} for {quote.what}."


def check(key: str, value: float, shown: str | None = None) -> str:
    """The quote, then ``value`` (printed as ``shown`` if given) and the verdict."""
    quote = QUOTES[key]
    here = shown if shown is not None else _show(*quote.reading(value))
    return f"{said(key)} Here: {here}, {quote.verdict(value)}."
