"""The browser playground at `/`, in Debian's own chromium (headless, driven by selenium through the
distribution's chromedriver; nothing downloads a browser). It holds a two-turn conversation over the Spark
WebSocket, the second request carrying the first turn (with `<end>`), shows an error frame's code, and
leaves a screenshot in test-artifacts/. Skipped where chromium is not installed."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


def test_the_page_is_served_without_a_key_and_works_offline(live_server):
    r = httpx.get(live_server.http_url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/turing/v3/gpt" in r.text and "http://" not in r.text and "https://cdn" not in r.text


@pytest.fixture
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("Debian's chromium and chromium-driver are not installed here")
    selenium = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = selenium.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=420,900"):
        options.add_argument(arg)  # a phone-sized window
    driver = selenium.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    yield driver
    driver.quit()


def test_a_two_turn_conversation_and_an_error_frame(live_server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 60)
    browser.get(live_server.http_url + "/")
    browser.execute_script("document.getElementById('top_k').value = 1; document.getElementById('max_tokens').value = 24")

    def ask(text: str, answers: int) -> None:
        browser.find_element(By.ID, "question").send_keys(text)
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant[data-done='1']")) >= answers)

    ask("What is the capital of France?", 1)
    first_answer = browser.execute_script("return history[1].content")
    assert first_answer.strip()
    ask("And of Italy?", 2)
    sent = browser.execute_script("return window.lastRequest")["payload"]["message"]["text"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[0]["content"] == "What is the capital of France?" and sent[1]["content"] == first_answer + "<end>"

    browser.execute_script("document.getElementById('max_tokens').value = 99999")  # over the spec's 4096
    browser.find_element(By.ID, "question").send_keys("One more?")
    browser.find_element(By.ID, "send").click()
    error = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, ".error")))
    assert error.get_attribute("data-code") == "10000" and "10000" in error.text
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "playground.png"))
    assert (ARTIFACTS / "playground.png").stat().st_size > 1000
