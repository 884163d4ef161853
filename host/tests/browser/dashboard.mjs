// Drives the dashboard in Debian's chromium for host/tests/dashboard.rs.
//   node dashboard.mjs URL TOKEN SCREENSHOT
// Talks to the test over stdio, one line each way per step:
//   prints  OWNERS <owner of each slot, comma-separated>   then waits for a line on stdin;
//   waits until a slot shows another owner, prints MOVED <slot> <owner>;
//   clicks the first dead letter's Redrive, waits until the table shows none, prints REDRIVEN;
//   takes the screenshot, prints DONE.
// Any failure prints FAIL <why> and exits 1.
import { chromium } from "playwright-core";
import { createInterface } from "node:readline";

const [url, token, screenshot] = process.argv.slice(2);
const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
const say = (s) => process.stdout.write(s + "\n");

async function owners(page) {
  return page.$$eval("#slots tbody tr", (rows) => rows.map((r) => r.querySelector(".owner").textContent.trim()));
}

async function waitFor(what, check, ms = 90000) {
  const until = Date.now() + ms;
  for (;;) {
    const got = await check();
    if (got) return got;
    if (Date.now() > until) throw new Error(`${what}: not within ${ms} ms`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

const browser = await chromium.launch({
  executablePath: process.env.WEIR_CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"],
});
try {
  const page = await browser.newPage({ viewport: { width: 1400, height: 900 } });
  page.on("pageerror", (e) => say("PAGEERROR " + e.message));
  await page.goto(url);
  // The node wants a token: the page asks for it.
  await page.waitForSelector("#login:not([hidden])");
  await page.fill("#token", token);
  await page.click("#signin");
  await page.waitForSelector("#app:not([hidden])");
  const first = await waitFor("four slots with an owner", async () => {
    const o = await owners(page);
    return o.length === 4 && o.every((x) => x && x !== "UNOWNED") ? o : null;
  });
  say("OWNERS " + first.join(","));
  await lines.next();
  const moved = await waitFor("a slot that changes owner", async () => {
    const o = await owners(page);
    const i = o.findIndex((x, n) => x !== first[n] && x !== "UNOWNED");
    return i >= 0 ? `${i} ${o[i]}` : null;
  });
  say("MOVED " + moved);
  await page.waitForSelector("#dead tbody tr[data-id] button");
  await page.click("#dead tbody tr[data-id] button");
  await waitFor("the dead letter leaves the table", async () =>
    (await page.$$("#dead tbody tr[data-id]")).length === 0);
  say("REDRIVEN");
  // A refresh with the new state before the picture.
  const seen = await page.evaluate(() => document.body.dataset.refreshed);
  await waitFor("a refresh", async () => (await page.evaluate(() => document.body.dataset.refreshed)) !== seen);
  await page.screenshot({ path: screenshot, fullPage: true });
  say("DONE");
} catch (e) {
  say("FAIL " + e.message);
  process.exitCode = 1;
} finally {
  await browser.close();
}
