"""The chat page at ``/`` in a real headless Chromium (Selenium) over a real ``chatkit serve``: a message
and its streamed reply, a tool call run in the page, regenerate, edit-and-resend, undo, Stop, and a
conversation found again after a reload and after a restart of the server. What the page shows is
checked against what the server stored. Skipped where Chromium or chromedriver is not installed
(Debian: ``apt-get install chromium chromium-driver``; .ci/run installs them)."""

from __future__ import annotations

import shutil

import httpx
import pytest

pytestmark = pytest.mark.slow

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra has it)")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("no headless browser: install Chromium and its driver (Debian: apt-get install chromium "
                "chromium-driver; .ci/run does)", allow_module_level=True)


def chrome() -> webdriver.Chrome:
    """Headless Chromium with the options a container needs."""
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,800"):
        options.add_argument(arg)
    options.binary_location = CHROMIUM
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(CHROMEDRIVER))


@pytest.fixture(scope="module")
def browser():
    driver = chrome()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server(serve_process):
    return serve_process(["--max-tokens", "48"])


# -- driving the page -----------------------------------------------------------------------------
def wait(driver, condition, timeout=30.0):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition())


def idle(driver) -> None:
    """Until the page is ready for the next message (the Send button back, Stop gone)."""
    wait(driver, lambda: driver.find_element(By.ID, "send").is_displayed())


def open_page(driver, url: str) -> None:
    driver.get(url + "/")
    wait(driver, lambda: driver.find_element(By.ID, "model-name").text != "chatkit")  # it asked /v1/models


def send(driver, text: str) -> None:
    box = driver.find_element(By.ID, "prompt")
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()  # the page is busy from the click on
    idle(driver)


def click(driver, label: str, index: int = -1) -> None:
    buttons = [b for b in driver.find_elements(By.CSS_SELECTOR, "#messages button") if b.text == label]
    buttons[index].click()


def head(driver) -> str:
    """The response the page chains its next message on (it keeps it in the address)."""
    return driver.execute_script("return location.hash.slice(1)")


def shown(driver) -> list[tuple[str, str]]:
    """What the conversation shows: (kind, text) for each message and tool item, texts exact."""
    return [tuple(x) for x in driver.execute_script("""
        return [...document.querySelectorAll('#messages > *')].map((el) => el.classList.contains('tool')
            ? ['tool', el.textContent]
            : [el.classList.contains('user') ? 'user' : 'assistant',
               [...el.querySelectorAll('.text, .tool')].map((t) => t.textContent).join('|')]);""")]


def stat(driver, name: str) -> str:
    return driver.find_element(By.ID, f"stat-{name}").text


# -- what the server stored -------------------------------------------------------------------------
def chain(url: str, rid: str, key: str | None = None) -> list[dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{url}/v1/conversations/{rid}", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def text_of(response: dict) -> str:
    return "".join(p["text"] for item in response["output"] if item["type"] == "message" for p in item["content"])


def conversations(url: str) -> list[dict]:
    return httpx.get(f"{url}/v1/conversations", timeout=30).json()["data"]


# -- the tests ------------------------------------------------------------------------------------
def test_a_message_and_its_streamed_reply(browser, server):
    open_page(browser, server.url)
    browser.execute_script("""
        window.textChanges = 0;
        new MutationObserver((records) => { window.textChanges += records.filter(
            (r) => r.target.classList?.contains('text')).length; })
          .observe(document.getElementById('messages'), {childList: true, subtree: true});""")
    send(browser, "My name is Noor.")
    turns = chain(server.url, head(browser))
    (turn,) = turns
    reply = text_of(turn["response"])
    assert "Noor" in reply and turn["response"]["status"] == "completed"
    assert shown(browser) == [("user", "My name is Noor."), ("assistant", reply)]
    assert browser.execute_script("return window.textChanges") >= 3  # it grew delta by delta
    usage = turn["response"]["usage"]
    assert stat(browser, "prompt") == str(usage["input_tokens"])
    assert stat(browser, "ttft").endswith(" ms") and float(stat(browser, "tps")) > 0
    assert [c["title"] for c in conversations(server.url)][0] == "My name is Noor."
    assert browser.find_element(By.CSS_SELECTOR, "#conversations li.current .title").text == "My name is Noor."


def test_tool_calls_regenerate_edit_and_undo(browser, server):
    open_page(browser, server.url)
    send(browser, "My name is Ada.")
    first = head(browser)
    send(browser, "What is 25 + 30?")  # the model calls calculate, the page runs it and sends the result
    asked = head(browser)
    calls = [t["response"]["output"] for t in chain(server.url, asked)]
    call = next(item for item in calls[1] if item["type"] == "function_call")
    assert ("tool", "result: 55") in shown(browser)
    assert f"call: calculate({call['arguments']})" in shown(browser)[3][1]
    assert "55" in text_of(chain(server.url, asked)[-1]["response"])
    before = shown(browser)

    click(browser, "Regenerate")  # the same question again from the first exchange: a branch
    idle(browser)
    regenerated = chain(server.url, head(browser))
    assert head(browser) != asked and regenerated[0]["response"]["id"] == first
    assert len(regenerated) == 3 and regenerated[1]["response"]["previous_response_id"] == first
    assert shown(browser) == before  # greedy: the same replies, from the same conversation

    click(browser, "Edit", 1)  # the second user message, edited and sent: another branch
    area = browser.find_element(By.CSS_SELECTOR, "#messages textarea")
    area.clear()
    area.send_keys("What did I say my name was?")
    click(browser, "Send")
    idle(browser)
    edited = chain(server.url, head(browser))
    assert [t["response"]["id"] for t in edited][:1] == [first] and len(edited) == 2
    assert "Ada" in text_of(edited[1]["response"])
    assert shown(browser)[2] == ("user", "What did I say my name was?")

    browser.find_element(By.ID, "undo").click()  # back to the first exchange
    assert head(browser) == first and len(shown(browser)) == 2
    send(browser, "What is my name?")
    assert chain(server.url, head(browser))[1]["response"]["previous_response_id"] == first
    # every branch is one conversation in the list, its newest response its head
    listed = [c for c in conversations(server.url) if c["id"] == first]
    assert len(listed) == 1 and listed[0]["head"] == head(browser)


def test_stop_keeps_what_was_generated(browser, tiny):
    from chatkit import GenerateParams
    from chatkit.server import ServerConfig, start

    lm = tiny("qwen3", "bpe", 0)  # random weights: a long reply that does not end by itself
    with start(lm, ServerConfig(model_id="tiny", defaults=GenerateParams(max_tokens=4000))) as running:
        url = running.url.removesuffix("/v1")
        open_page(browser, url)
        browser.find_element(By.ID, "use-calculator").click()
        browser.find_element(By.ID, "prompt").send_keys("Hello")
        browser.find_element(By.ID, "send").click()
        wait(browser, lambda: len(browser.execute_script(
            "return document.querySelector('.message.assistant .text')?.textContent ?? ''")) > 40)
        browser.find_element(By.ID, "stop").click()
        idle(browser)
        (turn,) = chain(url, head(browser))
    stored = turn["response"]
    assert stored["status"] == "cancelled" and 0 < stored["usage"]["output_tokens"] < 4000
    assert shown(browser) == [("user", "Hello"), ("assistant", text_of(stored))]  # as the server kept it
    assert "stopped" in browser.find_element(By.CSS_SELECTOR, ".message.assistant .status").text


def test_reasoning_is_shown_collapsed(browser, tiny):
    from chatkit import GenerateParams
    from chatkit.server import ServerConfig, start
    from chatkit.testing import Scripted

    lm = tiny("qwen3", "bpe-think", 0)  # random weights, made to think and answer by a scripted processor
    script = Scripted(lm.tokenizer, ["<think>\nThe user greets me.\n</think>\n\nHello there."])
    with start(lm, ServerConfig(defaults=GenerateParams(max_tokens=40, logits_processors=[script]))) as running:
        browser.get(running.url.removesuffix("/v1") + "/")
        idle(browser)
        send(browser, "Hi")
        rid = head(browser)
        output = httpx.get(f"{running.url}/responses/{rid}", timeout=30).json()["output"]
    reasoning = browser.find_element(By.CSS_SELECTOR, ".message.assistant details.reasoning")
    assert reasoning.get_attribute("open") is None  # collapsed: only its summary shows
    assert reasoning.find_element(By.TAG_NAME, "summary").text == "Reasoning"
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert reasoning.find_element(By.CSS_SELECTOR, ".text").get_attribute("textContent") == \
        output[0]["content"][0]["text"] != ""
    assert shown(browser)[-1] == ("assistant", f"{output[0]['content'][0]['text']}|Hello there.")


def test_with_an_api_key_the_page_asks_for_it(browser, tiny):
    from chatkit import GenerateParams
    from chatkit.server import ServerConfig, start

    config = ServerConfig(model_id="keyed", api_key="sesame", defaults=GenerateParams(max_tokens=16))
    with start(tiny("qwen3", "bpe", 0), config) as running:
        browser.get(running.url.removesuffix("/v1") + "/#resp_from_elsewhere")
        form = browser.find_element(By.ID, "key-form")
        wait(browser, form.is_displayed)  # the API said 401
        assert "API key" in browser.find_element(By.ID, "error").text
        browser.find_element(By.ID, "api-key").send_keys("sesame")
        form.find_element(By.TAG_NAME, "button").click()
        wait(browser, lambda: "keyed" in browser.find_element(By.ID, "model-name").text)
        assert not form.is_displayed()
        browser.find_element(By.ID, "use-calculator").click()
        send(browser, "Hi")
        (turn,) = chain(running.url.removesuffix("/v1"), head(browser), "sesame")
        assert shown(browser) == [("user", "Hi"), ("assistant", text_of(turn["response"]))]
    browser.execute_script("localStorage.clear()")


def test_a_conversation_is_found_again_after_a_reload_and_a_restart(browser, server):
    open_page(browser, server.url)
    send(browser, "I live in Lisbon.")
    before, rid = shown(browser), head(browser)

    def reopen() -> None:
        open_page(browser, server.url)  # a new page, no conversation open
        wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "#conversations li"))
        entry = browser.find_elements(By.CSS_SELECTOR, "#conversations li")[0]
        assert entry.find_element(By.CSS_SELECTOR, ".title").text == "I live in Lisbon."
        entry.click()
        wait(browser, lambda: head(browser) == rid)
        assert shown(browser) == before

    browser.refresh()  # the address names the conversation: it opens again by itself
    wait(browser, lambda: len(shown(browser)) == 2)
    assert shown(browser) == before and head(browser) == rid
    reopen()
    server.restart()
    reopen()
    send(browser, "Where do I live?")
    assert "Lisbon" in shown(browser)[-1][1]
    reused = int(stat(browser, "reused").split()[0])
    assert reused > 0  # the conversation's cache came back from the store with it


def test_a_conversation_whose_first_turn_was_deleted_still_opens(browser, server):
    """Issue 51, item 3: the page lists and opens what is left of a conversation after one of its
    responses was deleted, saying that earlier turns were deleted."""
    open_page(browser, server.url)
    send(browser, "Remember the word tulip.")
    first = head(browser)
    send(browser, "Which word?")
    rid = head(browser)
    assert httpx.delete(f"{server.url}/v1/responses/{first}", timeout=30).status_code == 200
    open_page(browser, server.url)
    wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "#conversations li"))
    entry = browser.find_elements(By.CSS_SELECTOR, "#conversations li")[0]
    assert entry.find_element(By.CSS_SELECTOR, ".title").text == "Which word?"
    entry.click()
    wait(browser, lambda: head(browser) == rid)
    assert browser.find_element(By.CSS_SELECTOR, "#messages .gap").text == "Earlier turns of this conversation were deleted."
    assert [kind for kind, _ in shown(browser)] == ["assistant", "user", "assistant"]  # the note, then the turn


def test_the_conversation_list_loads_more_as_it_scrolls(browser, server):
    """Issue 51, item 5: the page shows the first page of conversations and the next as the list scrolls."""
    for i in range(24):
        r = httpx.post(f"{server.url}/v1/responses", json={"input": f"Topic {i}", "max_output_tokens": 1}, timeout=60)
        assert r.status_code == 200, r.text
    total, after = 0, None
    while True:
        page = httpx.get(f"{server.url}/v1/conversations", params={"limit": 100, **({"after": after} if after else {})},
                         timeout=30).json()
        total, after = total + len(page["data"]), page["last_id"]
        if not page["has_more"]:
            break
    open_page(browser, server.url)
    entries = lambda: browser.find_elements(By.CSS_SELECTOR, "#conversations li")  # noqa: E731
    wait(browser, lambda: len(entries()) >= 20)
    assert len(entries()) < total
    while len(entries()) < total:
        shown_before = len(entries())
        browser.execute_script("const s = document.getElementById('sidebar'); s.scrollTop = s.scrollHeight;")
        wait(browser, lambda n=shown_before: len(entries()) > n, timeout=10)  # the next page, once scrolled
    assert len(entries()) == total
    assert entries()[0].find_element(By.CSS_SELECTOR, ".title").text == "Topic 23"
