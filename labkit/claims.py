"""The figures the course texts quote (the five the course is built from), held here once, and a verdict on
a figure that a notebook measured or worked out: inside the quoted range or not, or for a single figure
whether it agrees. A notebook prints the quote beside its own figure, so that a student sees which of the
figures they read hold on their machine and which were slips; the few claims the texts make without a
figure (REMARKS) are printed the same way, beside what the notebook found. The texts' words stay in the
texts: each quote keeps only its figure and what it is a figure of, each remark a paraphrase."""
import math
import re
from dataclasses import dataclass
from pathlib import Path

from labkit import notebook
from labkit.bench import format_number

TEXTS = {"chapter": "the textbook chapter", "summary": "the summary", "guide": "the study guide",
         "survey": "the survey section", "blog": "the blog post"}
_SCALE = {"x": 1.0, "%": 1.0, "FLOP/byte": 1.0, "GB": 1e9, "MB": 1e6, "ms": 1e-3}  # one unit, in the value's units
_BINARY = {"GB": float(1 << 30), "MB": float(1 << 20)}  # texts often write GB where they computed GiB
AGREES = 0.05  # a single figure agrees with a value that differs from it by at most 5%; a range's edge is "just" missed


def _with_unit(figure: str, unit: str) -> str:
    """'2-3x', '30%', but '5.2 GB': a ratio's and a share's sign close up, a unit stands apart."""
    return f"{figure}{unit}" if unit in ("x", "%") else f"{figure} {unit}"


def _check_texts(texts: tuple[str, ...]) -> None:
    if not texts or any(text not in TEXTS for text in texts):
        raise ValueError(f"texts={texts!r}: each must be one of the course texts, {', '.join(TEXTS)}")


@dataclass(frozen=True)
class Remark:
    """A claim the texts make without a figure: ``texts`` (keys of TEXTS) say ``says``, in the lab's words.
    ``anchors`` (at least one): patterns that find it in each text (the tests look for them)."""
    texts: tuple[str, ...]
    says: str
    anchors: tuple[str, ...]

    def __post_init__(self) -> None:
        _check_texts(self.texts)
        if not self.anchors:
            raise ValueError(f"a remark needs anchors that find it in its texts: {self.says!r} has none")


@dataclass(frozen=True)
class Quote:
    """``texts`` (keys of TEXTS) quote, for ``what``, ``low`` to ``high`` in ``unit``:
    - ``high`` None: the single figure ``low``, which must be positive;
    - ``high`` math.inf: at least ``low`` (a text's "100+");
    - ``low`` 0: under ``high`` (a text's "< 4%").
    ``gib``: the texts' own arithmetic shows that their GB or MB are GiB or MiB, so values are read in those.
    ``anchors``: patterns that find the figure in each text where the text words it otherwise than
    ``figure()`` does, or where the figure is derived from others it gives (the tests look for them)."""
    texts: tuple[str, ...]
    what: str
    low: float
    high: float | None = None
    unit: str = "x"
    gib: bool = False
    anchors: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_texts(self.texts)
        if self.unit not in _SCALE:
            raise ValueError(f"unit={self.unit!r} is not one of {', '.join(_SCALE)}")
        if self.high is None and not self.low > 0:
            raise ValueError(f"a single figure must be positive, not {self.low}")
        if self.high is not None and not 0 <= self.low <= self.high:
            raise ValueError(f"the range {self.low} to {self.high} is empty or negative")
        if self.gib and (self.unit not in _BINARY or self.high is not None):
            raise ValueError(f"gib=True needs a single figure in {' or '.join(_BINARY)}")

    def figure(self) -> str:
        """The quoted figure as the text gives it: '2-3x', '5.2 GB', '100+ GB', '<4%'."""
        figure = (f"{self.low:g}" if self.high is None else f"{self.low:g}+" if math.isinf(self.high)
                  else f"<{self.high:g}" if self.low == 0 else f"{self.low:g}-{self.high:g}")
        return _with_unit(figure, self.unit)

    def reading(self, value: float) -> tuple[float, str]:
        """``value`` (a ratio, percentage points, bytes or seconds) in the quote's unit, and that unit: GiB or
        MiB where the quote's GB or MB mean those (``gib``)."""
        if not math.isfinite(value):
            raise ValueError(f"value={value} is not a finite figure")
        if self.gib:
            return value / _BINARY[self.unit], self.unit[0] + "iB"
        return value / _SCALE[self.unit], self.unit

    def verdict(self, value: float) -> str:
        """Where ``value`` falls against the quote: inside its range, or (just, within AGREES of its edge)
        below or above it; for a single figure, agrees (within AGREES) or how far off."""
        shown, unit = self.reading(value)
        if self.high is not None:
            if self.low <= shown <= self.high:
                return "inside its range"
            edge = self.low if shown < self.low else self.high
            near = "just " if edge and abs(shown / edge - 1) <= AGREES else ""
            return f"{near}{'below' if shown < self.low else 'above'} its range"
        how = f", its {self.unit} read as {unit}" if unit != self.unit else ""
        ratio = shown / self.low
        if abs(ratio - 1) <= AGREES:
            return f"agrees{how}"
        if ratio <= 0:  # a change of the opposite sign, or none: no multiple of the quote
            return "below it"
        if ratio < 1:  # some of it is there: never "100% below"
            return f"{min(99, round(100 * (1 - ratio)))}% below it{how}"
        if round(100 * (ratio - 1)) < 100:
            return f"{round(100 * (ratio - 1))}% above it{how}"
        return f"{format_number(ratio)} times it{how}"

    def spread_verdict(self, lowest: float, highest: float) -> str:
        """Where figures measured over several cases, from ``lowest`` to ``highest``, fall against the quote,
        each as it stands: no tolerance, since they are many cases and not one figure (so against a single
        figure, "all inside it" only where every case equals it)."""
        if lowest > highest:
            raise ValueError(f"lowest={lowest} is above highest={highest}")
        (low, _), (high, _) = self.reading(lowest), self.reading(highest)
        top = self.low if self.high is None else self.high
        it = "it" if self.high is None else "its range"
        if high < self.low or low > top:
            below = high < self.low
            nearest, edge = (high, self.low) if below else (low, top)
            near = f", the {'highest' if below else 'lowest'} just {'below' if below else 'above'}" \
                if edge and abs(nearest / edge - 1) <= AGREES else ""
            return f"all {'below' if below else 'above'} {it}{near}"
        if self.low <= low and high <= top:
            return f"all inside {it}"
        if self.high is None:
            return "they span it"
        start = "below its range" if low < self.low else "inside its range"
        return f"from {start} to above it" if high > top else f"from {start} into it"


QUOTES = {
    # notebook 00: the roofline
    "decode_intensity": Quote(("summary",), "decode's arithmetic intensity", 1, unit="FLOP/byte",
                              anchors=(r"approximately 1\b",)),
    "compute_per_byte": Quote(("summary",), "how much more compute than memory bandwidth GPUs offer", 100, 1000),
    "token_70b_a100": Quote(("blog",), "a decode step of a 70B model in fp16 on an A100", 70, unit="ms"),
    # notebook 01: what the cache saves
    "cache_speedup": Quote(("chapter",), "the KV cache's speed-up at typical generation lengths", 10, 50),
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
    "kv_70b_128k": Quote(("survey",), "a 70B model's cache at 128K tokens (the text adds: often more than its weights)",
                         100,
                         math.inf, unit="GB"),
    "gqa_saves": Quote(("summary",), "what GQA cuts the cache by", 4),
    "mqa_saves": Quote(("summary",), "what MQA cuts the cache by", 8),
    "mqa_saves_chapter": Quote(("chapter",), "what MQA cuts the cache by, for a model of 32 heads", 32),
    "gqa_saves_blog": Quote(("blog",), "what GQA cuts the cache by, in Llama 2 70B", 8),
    "kv_int8": Quote(("blog",), "an int8 KV cache's cut in memory against fp16", 2),
    "kv_quantized": Quote(("guide",), "KV-cache quantization's cut in memory (INT8 or INT4)", 2, 4),
    # notebook 03: the paged cache
    "paged_waste": Quote(("guide",), "the share of a paged cache's memory wasted", 0, 4, "%"),
    "contiguous_waste": Quote(("guide",), "the share wasted by contiguous allocation", 60, 80, "%"),
    "paged_requests": Quote(("summary",), "how many more requests run at once with paged attention", 2, 4),
    "paged_requests_chapter": Quote(("chapter",), "the same, which it counts as throughput", 3, 4),
    # notebook 04: continuous against static batching
    "batching_throughput": Quote(("summary", "blog"), "continuous batching's throughput over static batching's", 10, 20),
    "batching_throughput_guide": Quote(("guide",), "the same", 5, 10),
    "batching_throughput_survey": Quote(("survey",), "the same", 2, 36),
    "batching_latency": Quote(("chapter",), "continuous batching's cut in average latency", 2, 10),
    "static_utilization": Quote(("guide",), "the GPU's utilization under static batching", 30, 50, "%"),
    # notebook 05: speculative decoding
    "speculation_speedup": Quote(("chapter", "summary", "guide"), "speculative decoding's speed-up", 2, 3),
    "speculation_at_60_80": Quote(("chapter", "survey"), "the speed-up at acceptance rates of 60-80%", 2, 3),
    "draft_faster": Quote(("chapter",), "how many times faster the draft model's step is than the target's", 10),
    "draft_smaller": Quote(("chapter",), "how many times smaller the draft model is than the target", 10, 20),
    "speculation_compute": Quote(("chapter",), "speculative decoding's total compute against the target alone's",
                                 1.1, 1.2, anchors=(r"overhead is ~1\.1-1\.2",)),
    # notebook 06: weight quantization's bytes and quality
    "int8_memory": Quote(("chapter",), "INT8's cut in weight memory", 2),
    "int4_memory": Quote(("chapter",), "INT4's cut in weight memory", 4),
    "int4_70b": Quote(("chapter", "blog"), "Llama-2 70B's weights in INT4", 35, unit="GB"),
    "int8_quality": Quote(("blog",), "INT8's loss of quality", 1, unit="%"),
    "int4_quality": Quote(("chapter",), "INT4's rise in perplexity with GPTQ or AWQ", 1, 2, "%"),
    "gptq_quality": Quote(("blog",), "GPTQ's loss of quality at 4 bits", 2, 5, "%"),
    # notebook 06b: fused INT4 decode, and a model with outliers
    "int4_speed": Quote(("blog",), "INT4 decode's speed-up over FP16 (its GPTQ and AWQ rows)", 2, 3),
    "quantized_latency": Quote(("guide",), "quantization's cut in latency from FP16", 1.5, 3),
    "awq_quality": Quote(("blog",), "AWQ's loss of quality at 4 bits", 1, 3, "%"),
    # notebook 07: FlashAttention
    "flash_memory": Quote(("guide",), "FlashAttention's cut in memory", 2, 4),
    "flash_speed": Quote(("blog",), "FlashAttention's speed-up over standard attention", 2, 4),
    "flash_speed_guide": Quote(("guide",), "the same", 2),
    # notebook 08: compilation
    "compile_speedup": Quote(("survey",), "compiling the decode step, against eager", 1.5, 2),
    # notebook 09: serving
    "batch32_step": Quote(("chapter",), "the latency at batch 32 against batch 1 (its table's 80 against 10 ms)", 8,
                          anchors=(r"Batch size 1: 10 ms", r"Batch size 32: 80 ms")),
    "batch32_throughput": Quote(("chapter",), "the requests per second at batch 32 against batch 1 (its table's 400 "
                                "against 100)", 4, anchors=(r"100 req/sec", r"400 req/sec")),
    "prefix_ttft": Quote(("summary",), "prefix caching's cut in the time to first token", 5, 10),
    "prefix_prefill": Quote(("guide",), "the prefill time prefix caching saves", 50, 90, "%"),
    # notebook 10: disaggregated serving
    "splitwise_throughput": Quote(("survey",), "what disaggregation buys in throughput (Splitwise)", 1.4),
    "splitwise_latency": Quote(("survey",), "what disaggregation buys in latency instead", 2.35),
    # notebook 11: speculation without a draft model
    "medusa_speedup": Quote(("survey",), "Medusa's speed-up", 2, 3),
}


REMARKS = {
    "dozens": Remark(("chapter",), "dozens of 2,048-token sequences fit beside Llama-2 70B's INT4 weights on an 80 GB A100",
                     anchors=(r"80GB A100.{0,40}INT4", r"dozens of concurrent")),
    "batch32_cache": Remark(("blog",), "the cache of a 70B Llama with 64 heads, for 32 sequences of 2,048 tokens in fp16, "
                            "exceeds most GPUs' memory", anchors=(r"batch size 32, sequence length 2048", r"exceeds most GPU")),
    "tokens_per_call": Remark(("survey",), "a target call yields 1/(1 - a) tokens on average at acceptance rate a",
                              anchors=(r"per target model call is 1/\(1-alpha\)",)),
    "awq_over_gptq": Remark(("blog",), "AWQ usually gives better quality than GPTQ at the same bits",
                            anchors=(r"AWQ.{0,30}better quality.{0,20}than GPTQ",)),
    "tp_linear": Remark(("guide",), "tensor parallelism cuts latency in proportion to the number of GPUs",
                        anchors=(r"Tensor Parallelism \|[^\n]*Linear latency scaling",)),
}


def said(key: str) -> str:
    """The quote (or remark) as a sentence: which texts, and the figure and what it is a figure of (or what
    they say)."""
    claim = REMARKS[key] if key in REMARKS else QUOTES[key]
    names = [TEXTS[text] for text in claim.texts]
    who = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    what = claim.says if isinstance(claim, Remark) else f"{claim.figure()} for {claim.what}"
    return f"{who[0].upper()}{who[1:]}: {what}."


def check(key: str, value: float, shown: str | None = None) -> str:
    """The quote, then ``value`` (printed as ``shown`` if given) and the verdict."""
    quote = QUOTES[key]
    number, unit = quote.reading(value)
    here = shown if shown is not None else _with_unit(format_number(number), unit)
    return f"{said(key)} Here: {here}, {quote.verdict(value)}."


def check_spread(key: str, lowest: float, highest: float, shown: str) -> str:
    """The quote, then figures measured over several cases (``shown``, from ``lowest`` to ``highest``) and
    the verdict."""
    return f"{said(key)} Here: {shown}, {QUOTES[key].spread_verdict(lowest, highest)}."


SOLUTIONS = Path(__file__).resolve().parent.parent / "solutions"
_NAMED = re.compile(r"""claims\.(?:check|check_spread|said)\(\s*["'](\w+)["']|claims\.QUOTES\[["'](\w+)["']\]""")


def printed_by(folder: Path = SOLUTIONS) -> dict[str, list[str]]:
    """Which notebooks in ``folder`` print each quote and remark, by key: a notebook counts when one of its
    code cells calls this module and names the key as a string (in the call, or in a list the cell loops
    over); keys no notebook prints map to []. Raises on a key that a call here names and neither QUOTES
    nor REMARKS has."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder of notebooks (the solutions are in the repository's)")
    users: dict[str, list[str]] = {key: [] for key in QUOTES | REMARKS}
    for path in sorted(folder.glob("*.ipynb")):
        cells = [notebook.source(cell) for cell in notebook.read(path)["cells"] if cell.get("cell_type") == "code"]
        calling = [code for code in cells if "claims." in code]
        unknown = {key for code in calling for pair in _NAMED.findall(code) for key in pair
                   if key and key not in users}
        if unknown:
            raise KeyError(f"{path.name} names quotes or remarks that labkit.claims lacks: {', '.join(sorted(unknown))}")
        for key in users:
            if any(f'"{key}"' in code or f"'{key}'" in code for code in calling):
                users[key].append(path.stem)
    return users


def main() -> None:
    """``python -m labkit.claims``: every quote and remark, its texts and the notebooks that set a measured
    figure beside it."""
    users = printed_by()
    for key, claim in (QUOTES | REMARKS).items():
        texts = ", ".join(TEXTS[text].removeprefix("the ") for text in claim.texts)
        figure, what = ("no figure", claim.says) if isinstance(claim, Remark) else (claim.figure(), claim.what)
        print(f"{figure:>10}  {what} ({texts}): {', '.join(users[key]) or 'no notebook'}")


if __name__ == "__main__":
    main()
