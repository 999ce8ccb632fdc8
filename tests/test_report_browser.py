"""The HTML report in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`,
driven by Selenium) opens report.html from disk; every figure report.md holds decoded (natural width > 0) and
every table of report.md rendered with its columns and rows. Skipped, saying what is missing, where Chromium is not installed."""

import shutil

import pytest
from test_report import _study

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
DRIVER = shutil.which("chromedriver")


def _browser():
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("headless Chromium is not installed: apt-get install chromium chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed: pip install -e '.[dev]'")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(DRIVER), options=options)


@pytest.mark.slow
def test_the_html_report_renders_in_chromium(tmp_path):
    from toolcollapse.report import write_report

    md = write_report(*_study(tmp_path))
    page = md.with_suffix(".html")
    lines = md.read_text().splitlines()
    figures = [line for line in lines if line.startswith("![")]
    headers = [len(head.split(" | ")) for head, rule in zip(lines, lines[1:]) if rule.startswith("|---")]
    assert len(figures) >= 3 and len(headers) >= 8, (len(figures), headers)
    browser = _browser()
    try:
        browser.get(page.as_uri())
        images = browser.execute_script(
            "return Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.naturalHeight])")
        tables = browser.execute_script(
            "return Array.from(document.querySelectorAll('table')).map(t => [t.rows.length, t.rows[0].cells.length, t.offsetHeight])")
    finally:
        browser.quit()
    assert len(images) == len(figures) and all(done and w > 0 and h > 0 for done, w, h in images), images
    assert [cols for _, cols, _ in tables] == headers, (tables, headers)
    assert all(rows >= 2 and height > 0 for rows, _, height in tables), tables
