"""labkit.claims: the course texts' figures and the verdicts on figures measured here."""
import json
import math
import re
import subprocess
from pathlib import Path

import pytest

from labkit import claims
from labkit.claims import Quote, Remark

COURSE_TEXTS = "../shared/course_texts"  # beside the repository, where the course's texts are kept


def test_a_quote_names_known_texts_and_units_and_a_range_that_is_not_empty() -> None:
    with pytest.raises(ValueError, match="course texts"):
        Quote(("textbook",), "x", 2, 3)
    with pytest.raises(ValueError, match="course texts"):
        Quote((), "x", 2, 3)
    with pytest.raises(ValueError, match="unit='GiB'"):
        Quote(("chapter",), "x", 2, unit="GiB")
    with pytest.raises(ValueError, match="empty or negative"):
        Quote(("chapter",), "x", 3, 2)
    with pytest.raises(ValueError, match="empty or negative"):
        Quote(("chapter",), "x", -2, 3)
    for figure in (0, -1):
        with pytest.raises(ValueError, match="single figure must be positive"):
            Quote(("chapter",), "x", figure)
    for value in (math.nan, math.inf):
        with pytest.raises(ValueError, match="not a finite figure"):
            Quote(("chapter",), "x", 2, 3).verdict(value)


def test_a_remark_names_known_texts_and_is_said_as_a_sentence() -> None:
    with pytest.raises(ValueError, match="course texts"):
        Remark(("textbook",), "x", anchors=("x",))
    with pytest.raises(ValueError, match="course texts"):
        Remark((), "x", anchors=("x",))
    with pytest.raises(ValueError, match="needs anchors"):
        Remark(("blog",), "x", ())
    assert claims.said("awq_over_gptq") == "The blog post: AWQ usually gives better quality than GPTQ at the same bits."
    assert not claims.QUOTES.keys() & claims.REMARKS.keys(), "a key in both: said() would hide the quote"


def test_figures_are_written_as_the_texts_write_them() -> None:
    assert Quote(("chapter",), "x", 2, 3).figure() == "2-3x"
    assert Quote(("chapter",), "x", 30, 50, "%").figure() == "30-50%"
    assert Quote(("chapter",), "x", 5.2, unit="GB").figure() == "5.2 GB"
    assert Quote(("chapter",), "x", 100, math.inf, "GB").figure() == "100+ GB"
    assert Quote(("chapter",), "x", 0, 4, "%").figure() == "<4%"


def test_a_range_says_inside_below_or_above() -> None:
    speedup = Quote(("chapter",), "x", 2, 3)
    assert [speedup.verdict(v) for v in (1.5, 1.99, 2, 2.5, 3, 3.01, 3.5)] == [
        "below its range", "just below its range", "inside its range", "inside its range", "inside its range",
        "just above its range", "above its range"]
    assert Quote(("guide",), "x", 0, 4, "%").verdict(-1) == "below its range"  # an edge of 0: nothing is near it
    at_least = Quote(("survey",), "x", 100, math.inf, "GB")
    assert at_least.verdict(43e9) == "below its range"
    assert at_least.verdict(344e9) == "inside its range"


def test_a_single_figure_agrees_within_five_percent_or_says_how_far_off() -> None:
    assert Quote(("chapter",), "x", 0.67, unit="GB").verdict(0.671e9) == "agrees"
    quote = Quote(("chapter",), "x", 10)
    assert quote.verdict(9.51) == quote.verdict(10.49) == "agrees"
    assert quote.verdict(10.6) == "6% above it"
    assert quote.verdict(7) == "30% below it"
    assert quote.verdict(42.9) == "4.29 times it"
    assert quote.verdict(2.5) == "75% below it"  # a fraction of the quote: how far below, not "0.25 times it"
    assert quote.verdict(0.04) == "99% below it"  # some of it is there: never "100% below"
    assert quote.verdict(19.96) == "2 times it" and quote.verdict(19.9) == "99% above it"
    assert quote.verdict(12345) == "1,234 times it"  # grouped, not 1.23e+03
    assert quote.verdict(0) == quote.verdict(-0.3) == "below it"  # no multiple of the quote


def test_gb_is_read_as_gib_only_where_the_quote_says_its_texts_meant_it() -> None:
    assert Quote(("guide",), "x", 16, unit="GB").verdict(2 ** 34) == "7% above it"  # 17.2 GB
    with pytest.raises(ValueError, match="gib=True"):
        Quote(("guide",), "x", 2, unit="x", gib=True)
    with pytest.raises(ValueError, match="gib=True"):
        Quote(("guide",), "x", 2, 3, unit="GB", gib=True)
    quote = Quote(("guide",), "x", 16, unit="GB", gib=True)
    assert quote.reading(2 ** 34) == (16.0, "GiB")
    assert quote.verdict(2 ** 34) == "agrees, its GB read as GiB"
    assert quote.verdict(16e9) == "7% below it, its GB read as GiB"  # 14.9 GiB
    assert Quote(("guide",), "x", 2, unit="GB", gib=True).verdict(2 ** 34) == "8 times it, its GB read as GiB"
    assert claims.check("kv_8b_128k_code", 2 ** 34).endswith("Here: 16 GiB, 8 times it, its GB read as GiB.")


def test_figures_over_several_cases_fall_below_above_inside_or_across_a_quote() -> None:
    speedup = Quote(("chapter",), "x", 10, 50)
    assert speedup.spread_verdict(3, 9.9) == "all below its range, the highest just below"
    assert speedup.spread_verdict(3, 8) == "all below its range"
    assert speedup.spread_verdict(51, 60) == "all above its range, the lowest just above"
    assert speedup.spread_verdict(60, 70) == "all above its range"
    assert speedup.spread_verdict(10, 50) == "all inside its range"
    assert speedup.spread_verdict(5, 20) == "from below its range into it"
    assert speedup.spread_verdict(20, 80) == "from inside its range to above it"
    assert speedup.spread_verdict(5, 80) == "from below its range to above it"  # none inside, maybe
    waste = Quote(("chapter",), "x", 0, 4, "%")  # "under 4%": an edge at 0, which nothing is divided by
    assert waste.spread_verdict(-2, -1) == "all below its range"
    single = Quote(("summary",), "x", 4)
    assert single.spread_verdict(2, 16) == "they span it"
    assert single.spread_verdict(16, 128) == "all above it"
    assert single.spread_verdict(4.1, 128) == "all above it, the lowest just above"
    assert single.spread_verdict(4, 4) == "all inside it"
    with pytest.raises(ValueError, match="above highest"):
        single.spread_verdict(3, 2)
    assert claims.check_spread("gqa_saves", 2, 16, "2x to 16x") == ("The summary: 4x for what GQA cuts the cache by. "
                                                                    "Here: 2x to 16x, they span it.")


def test_check_and_said_name_the_texts_the_figure_and_the_verdict() -> None:
    assert claims.said("speculation_speedup") == ("The textbook chapter, the summary and the study guide: 2-3x for "
                                                  "speculative decoding's speed-up.")
    assert claims.check("gqa_saves", 8) == "The summary: 4x for what GQA cuts the cache by. Here: 8x, 2 times it."
    assert claims.check("kv_8b_128k", 2 ** 34).endswith("Here: 16 GiB, agrees, its GB read as GiB.")
    assert claims.check("static_utilization", 41.23, "41% of rows").endswith("Here: 41% of rows, inside its range.")
    with pytest.raises(KeyError):
        claims.check("no such quote", 1)


def test_every_quote_is_printed_by_a_notebook_and_every_one_named_exists(tmp_path) -> None:
    assert {key: users for key, users in claims.printed_by().items() if not users} == {}, "quotes no notebook prints"
    lab = {"cells": [{"cell_type": "code", "source": 'print(claims.check("no_such_quote", 2.0))'}]}
    (tmp_path / "99_lab.ipynb").write_text(json.dumps(lab))
    with pytest.raises(KeyError, match="99_lab.ipynb names quotes or remarks that labkit.claims lacks: no_such_quote"):
        claims.printed_by(tmp_path)
    lab["cells"][0]["source"] = "for key in ('gqa_saves',):\n    print(claims.check(key, 4))"
    (tmp_path / "99_lab.ipynb").write_text(json.dumps(lab))
    assert claims.printed_by(tmp_path)["gqa_saves"] == ["99_lab"]
    lab["cells"] = [{"cell_type": "code", "source": 'share = stats["gqa_saves"]'},  # a key, but no call here
                    {"cell_type": "code", "source": "print(claims.said('mqa_saves'))"}]
    (tmp_path / "99_lab.ipynb").write_text(json.dumps(lab))
    printed = claims.printed_by(tmp_path)
    assert (printed["gqa_saves"], printed["mqa_saves"]) == ([], ["99_lab"])
    with pytest.raises(FileNotFoundError, match="not a folder of notebooks"):
        claims.printed_by(tmp_path / "absent")


def test_the_listing_names_each_quote_and_its_notebooks(capsys) -> None:
    claims.main()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(claims.QUOTES) + len(claims.REMARKS)
    assert "no figure  AWQ usually gives better quality than GPTQ at the same bits (blog post): 06b_fast_quantized_decode" \
        in [line.strip() for line in lines]
    assert "2-3x  speculative decoding's speed-up (textbook chapter, summary, study guide): 05_speculative_decoding" \
        in [line.strip() for line in lines]


def _figure_pattern(number: float) -> str:
    """``number`` as a text may write it: 2 as '2' or '2.00', not as part of '12' or '2.5'."""
    return rf"(?<![\d.]){re.escape(f'{number:g}')}(?:\.0+)?(?![\d]|\.\d)"


_LATEX = r"\s*(?:\\text\{)?"  # the chapter writes 0.67\text{GB}
_UNIT_PATTERNS = {"x": r"\s*[x\u00d7]", "%": r"\s*%", "GB": _LATEX + "GB", "MB": _LATEX + "MB", "ms": _LATEX + "ms"}


def _quote_pattern(quote: Quote) -> str:
    """The figure as the texts write it, with its unit: a range as 'low-high' with any dash, 'at least' as
    'low+', 'under' as '<high'."""
    low = _figure_pattern(quote.low)
    figure = (low if quote.high is None else low + r"\s*\+" if math.isinf(quote.high)
              else r"<\s*" + _figure_pattern(quote.high) if quote.low == 0
              else low + r"\s*[-\u2013]\s*" + _figure_pattern(quote.high))
    return figure + _UNIT_PATTERNS[quote.unit]


def test_a_quote_is_looked_for_with_its_unit() -> None:
    assert re.search(_quote_pattern(Quote(("blog",), "x", 70, unit="ms")), "70ms per token")
    assert not re.search(_quote_pattern(Quote(("blog",), "x", 70, unit="ms")), "a 70B model")
    assert re.search(_quote_pattern(Quote(("guide",), "x", 2, 3)), "2\u20133\u00d7 speedup")
    assert not re.search(_quote_pattern(Quote(("guide",), "x", 2, 3)), "2-3 GPUs or 12-3x")


def _beside(root: Path) -> list[Path]:
    """Where the course texts may be: beside this checkout, or, for a clone of a checkout on this machine (as
    CI makes one elsewhere), beside the checkout it was cloned from."""
    places = [root]
    try:
        origin = subprocess.run(["git", "-C", str(root), "remote", "get-url", "origin"], capture_output=True, text=True)
    except OSError:  # no git here: beside this checkout only
        origin = None
    if origin is not None and origin.returncode == 0 and (root / origin.stdout.strip()).is_dir():
        places.append(root / origin.stdout.strip())  # a relative origin is relative to the checkout
    return [(place / COURSE_TEXTS).resolve() for place in places]


def _texts(root) -> dict[str, str]:
    """The course texts by key of claims.TEXTS (000: the chapter, ... 004: the blog post); the test skips
    where they are found neither beside the checkout nor beside the one it was cloned from."""
    folders = _beside(root)
    files = next(({path.stem.split("_")[0]: path for path in found} for folder in folders
                  if (found := sorted(folder.glob("*.txt")))), {})
    if not files:
        pytest.skip(f"the course texts are not beside this checkout: looked in {', '.join(map(str, folders))}")
    return {key: files[f"{i:03d}"].read_text(encoding="utf-8") for i, key in enumerate(claims.TEXTS)}


def test_a_derived_figure_is_the_ratio_of_the_figures_its_anchors_find(root) -> None:
    texts = _texts(root)
    for key in ("batch32_step", "batch32_throughput"):
        quote = claims.QUOTES[key]
        base, top = (float(re.findall(r"\d+(?:\.\d+)?", re.search(anchor, texts["chapter"])[0])[-1])
                     for anchor in quote.anchors)  # the last number each anchor finds: 10 ms, then 80 ms
        assert top / base == quote.low, f"{key}: {top:g} / {base:g} is not {quote.figure()}"


def test_each_quote_is_in_the_texts_it_names(root) -> None:
    """Typed once from the texts: each figure, with its unit, must be in each text it is attributed to; a quote
    whose text words it otherwise, or whose figure is derived, and every remark, must have each of its
    anchors there."""
    texts = _texts(root)
    for key, quote in (claims.QUOTES | claims.REMARKS).items():
        for text in quote.texts:
            body = texts[text]
            for pattern in quote.anchors or (_quote_pattern(quote),):
                assert re.search(pattern, body), f"{key}: {pattern!r} is not in {claims.TEXTS[text]}"
