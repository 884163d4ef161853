// A canary on the dashboard, for host/tests/dashboard.rs:
//   node dashboard-canary.mjs URL TOKEN HANDLER
// with the operator's token: prints "CANARY <the handler's canary line>"
// once the page shows the running canary, clicks Promote (accepting the
// confirmation), and prints "PROMOTED" when the line is gone; "FAIL <why>"
// and exit 1 otherwise.
import { chromium } from "playwright-core";

const [url, token, handler] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.WEIR_CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"],
});
try {
  const page = await browser.newPage();
  page.on("dialog", (d) => d.accept());
  await page.goto(url);
  await page.waitForSelector("#login:not([hidden])");
  await page.fill("#token", token);
  await page.click("#signin");
  await page.waitForSelector("#app:not([hidden])");
  const line = `[data-canary="${handler}"]`;
  await page.waitForSelector(line, { timeout: 60000 });
  console.log("CANARY " + (await page.textContent(line)).replace(/\s+/g, " ").trim());
  // The table is redrawn every refresh: click in the page, at once.
  await page.$eval(`button[data-promote="${handler}"]`, (b) => b.click());
  await page.waitForSelector(line, { state: "detached", timeout: 60000 });
  console.log("PROMOTED");
} catch (e) {
  console.log("FAIL " + e.message);
  process.exitCode = 1;
} finally {
  await browser.close();
}
