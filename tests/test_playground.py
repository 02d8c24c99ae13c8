"""The browser playground at `/`, in Debian's own chromium (headless, driven by selenium through the
distribution's chromedriver; nothing downloads a browser). It holds a two-turn conversation over the Spark
WebSocket, the second request carrying the first turn (with `<end>`), follows new answers down the page,
marks an answer cut at max_tokens, shows the model's name and an error frame's code, names a refused
handshake (401) instead of a closed connection, and leaves a screenshot in test-artifacts/. Skipped where
chromium is not installed. The page is the server's, whatever answers: it runs on the scripted fake engine."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import pytest

from spark_server.settings import Settings
from tests.conftest import fake_server_with, free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
API_KEY = "playground-key"


def test_the_page_is_served_without_a_key_and_works_offline(fake):
    r = httpx.get(fake.http_url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/turing/v3/gpt" in r.text and "http://" not in r.text and "https://cdn" not in r.text
    config = json.loads(re.search(r"const CONFIG = (\{.*?\}) \|\|", r.text).group(1))
    assert config == {"model": fake.engine.model_info.name, "api_key": False, "spark_auth": False,
                      "path": "/turing/v3/gpt"}
    assert httpx.get(fake.http_url + "/playground/check").json()["status"] == 101


@pytest.fixture(scope="module")
def keyed_server():
    """A server that wants --api-key."""
    with fake_server_with(Settings(port=free_port(), api_key=API_KEY)) as server:
        yield server.http_url


def test_the_handshake_check_says_why_a_socket_is_refused(keyed_server):
    assert httpx.get(keyed_server + "/playground/check").status_code == 401  # the key, as a bearer header
    bearer = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.get(keyed_server + "/playground/check", headers=bearer)
    assert r.json()["status"] == 401 and "api_key" in r.json()["message"]  # the socket's URL would lack the key
    assert httpx.get(keyed_server + f"/playground/check?api_key={API_KEY}", headers=bearer).json()["status"] == 101


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


def test_a_two_turn_conversation_and_an_error_frame(fake, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 60)
    browser.set_window_size(420, 480)  # a short window: the conversation soon outgrows it
    browser.get(fake.http_url + "/")
    assert browser.find_element(By.ID, "model").text == fake.engine.model_info.name
    browser.execute_script("document.getElementById('top_k').value = 1; "
                           "document.getElementById('max_tokens').value = 24")

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

    browser.execute_script("document.getElementById('max_tokens').value = 3")  # surely cut there
    ask("Tell me a long story about the sea.", 3)
    last = browser.find_elements(By.CSS_SELECTOR, ".assistant[data-done='1']")[-1]
    assert last.get_attribute("data-finish") == "length"
    assert "cut at max_tokens = 3 (length)" in last.find_element(By.CSS_SELECTOR, ".cut").text
    assert fake.engine.model_info.name in last.find_element(By.CSS_SELECTOR, ".meta").text
    scrolled = browser.execute_script(
        "const r = arguments[0].getBoundingClientRect(); return [window.scrollY, r.bottom, window.innerHeight, "
        "document.documentElement.scrollHeight];", last)
    assert scrolled[0] > 0 and scrolled[1] <= scrolled[2], scrolled  # moved down: the newest answer is in view
    assert scrolled[0] + scrolled[2] >= scrolled[3] - 2, scrolled  # at the page's end

    browser.execute_script("document.getElementById('max_tokens').value = 99999")  # over the spec's 4096
    browser.find_element(By.ID, "question").send_keys("One more?")
    browser.find_element(By.ID, "send").click()
    error = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, ".error")))
    assert error.get_attribute("data-code") == "10000" and "10000" in error.text
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "playground.png"))
    assert (ARTIFACTS / "playground.png").stat().st_size > 1000


def test_a_refused_handshake_is_named_and_sign_is_not_called(keyed_server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 30)
    browser.get(keyed_server + "/")
    browser.execute_script("window.fetched = []; const f = window.fetch; "
                           "window.fetch = (u, o) => { window.fetched.push(String(u)); return f(u, o); };")

    def refused(key: str) -> str:
        browser.execute_script("document.getElementById('api_key').value = arguments[0]", key)
        before = len(browser.find_elements(By.CSS_SELECTOR, ".error"))
        browser.find_element(By.ID, "question").send_keys("Hello?")
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".error")) > before)
        error = browser.find_elements(By.CSS_SELECTOR, ".error")[-1]
        assert error.get_attribute("data-status") == "401"
        return error.text

    assert refused("") == ("the server refused the connection (401 Unauthorized): this server wants an API key: "
                           "enter it under Parameters")
    wrong = refused("not-the-key")
    assert "401 Unauthorized" in wrong and "invalid API key" in wrong and "closed before" not in wrong
    browser.execute_script("document.getElementById('api_key').value = arguments[0]; "
                           "document.getElementById('max_tokens').value = 4", API_KEY)
    browser.find_element(By.ID, "question").send_keys("Hello?")
    browser.find_element(By.ID, "send").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".assistant[data-done='1']"))
    assert not any("/playground/sign" in u for u in browser.execute_script("return window.fetched"))
