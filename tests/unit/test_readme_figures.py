"""The README's GPU figures are the ones the pages it cites measured: docs/speed.md's latest H100 run (the
first step cold and warm, steady tokens/s and MFU) is quoted, and every figure the paragraph gives is in
docs/speed.md or bench/GPU.md, to the precision the README rounds to. A new measurement on the page fails
this until the README says it too."""

import re
from decimal import Decimal

from helpers import REPO

NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?!\w)")


def gpu_paragraph() -> str:
    paragraphs = re.split(r"\n\s*\n", (REPO / "README.md").read_text())
    return next(p for p in paragraphs if "docs/speed.md#measured" in p)


def latest_h100_run() -> list[str]:
    """docs/speed.md's H100 figures: launch to the end of step 1 cold and warm, steady tokens/s, MFU."""
    page = (REPO / "docs" / "speed.md").read_text()
    measured = page.split("## Measured", 1)[1].split("**This CPU**", 1)[0]
    cold = re.search(r"^\| cold [^|]*\| ([\d.]+ s) \|", measured, re.M).group(1)
    warm = re.search(r"^\| warm [^|]*\| ([\d.]+ s) \|", measured, re.M).group(1)
    steady = re.search(r"Steady speed: ([\d,]+) to ([\d,]+) tokens/s, MFU ([\d.]+-[\d.]+)", measured)
    return [cold, warm, *steady.groups()]


def rounds_to(figure: str, text: str) -> bool:
    """Whether some number in `text`, rounded to `figure`'s decimals (or its thousands), is `figure`."""
    wanted = Decimal(figure.replace(",", ""))
    places = Decimal(1).scaleb(wanted.as_tuple().exponent)
    for found in NUMBER.findall(text):
        value = Decimal(found.replace(",", ""))
        if value.quantize(places) == wanted:
            return True
        zeros = len(figure) - len(figure.rstrip("0")) if "." not in figure else 0
        if zeros and round(value, -zeros) == wanted:
            return True
    return False


def test_the_readme_quotes_the_latest_gpu_run():
    paragraph = " ".join(gpu_paragraph().split())
    missing = [figure for figure in latest_h100_run() if figure not in paragraph]
    assert not missing, f"README.md's GPU paragraph lacks docs/speed.md's latest figures: {missing}"


def test_every_gpu_figure_in_the_readme_is_on_a_page_it_cites():
    cited = (REPO / "docs" / "speed.md").read_text() + (REPO / "bench" / "GPU.md").read_text()
    figures = [n for n in NUMBER.findall(gpu_paragraph()) if len(n.replace(",", "").lstrip("0.")) >= 2]
    unknown = [figure for figure in figures if not rounds_to(figure, cited)]
    assert not unknown, f"README.md's GPU paragraph gives figures its pages do not: {unknown}"
