"""Regenerate docs/images/web-page.png: the chat page of ``chatkit serve`` (the demo model) in headless
Chromium, after a short conversation with a tool call. Needs Chromium and chromedriver (Debian:
``apt-get install chromium chromium-driver``) and selenium (the test extra).

    python scripts/screenshot_page.py [--out docs/images/web-page.png]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import chatkit
from chatkit import GenerateParams
from chatkit.server import ServerConfig, start

from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

OUT = Path(__file__).resolve().parent.parent / "docs" / "images" / "web-page.png"
EARLIER = ["I live in Lisbon."]
SHOWN = ["My name is Noor.", "What is 25 + 30?", "What did I say my name was?"]


def chrome(width: int, height: int) -> webdriver.Chrome:
    chromium, driver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        raise SystemExit("Chromium and chromedriver are needed: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}",
                "--force-color-profile=srgb", "--hide-scrollbars"):
        options.add_argument(arg)
    options.binary_location = chromium
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(driver))


def send(driver: webdriver.Chrome, text: str) -> None:
    driver.find_element(By.ID, "prompt").send_keys(text)
    driver.find_element(By.ID, "send").click()
    WebDriverWait(driver, 60).until(lambda d: d.find_element(By.ID, "send").is_displayed())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"the PNG to write (default {OUT})")
    args = parser.parse_args()
    lm = chatkit.load("demo")
    with tempfile.TemporaryDirectory() as store:
        config = ServerConfig(model_id="demo", store=store, defaults=GenerateParams(max_tokens=64))
        with start(lm, config) as server:
            driver = chrome(1100, 860)
            try:
                driver.get(server.url.removesuffix("/v1") + "/")
                for text in EARLIER:
                    send(driver, text)
                driver.find_element(By.ID, "new-chat").click()
                for text in SHOWN:
                    send(driver, text)
                WebDriverWait(driver, 10).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#conversations li")) == 2)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                driver.save_screenshot(str(args.out))
            finally:
                driver.quit()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
