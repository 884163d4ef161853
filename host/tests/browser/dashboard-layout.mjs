// The dashboard's layout and dead-letter pages, for host/tests/dashboard.rs:
//   node dashboard-layout.mjs URL TOKEN HANDLER SCREENSHOT_DIR
// with a canary of HANDLER running and more than a page of dead letters, three of them
// `rejected`. At 1280 and 1920 px wide:
//   - before a token is typed, the login says nothing was refused;
//   - nothing is wider than the window, and no table is wider than its card;
//   - Promote and Roll back sit inside the handler's row;
//   - the dead letters show one page of 50, Older shows the next, and the reason filter
//     shows the three `rejected` ones and no pager;
// then prints "LAYOUT <width> ok" and saves SCREENSHOT_DIR/dashboard-<width>.png.
// "FAIL <why>" and exit 1 otherwise.
import { chromium } from "playwright-core";

const [url, token, handler, dir] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.WEIR_CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"],
});

function check(ok, what) {
  if (!ok) throw new Error(what);
}

async function waitFor(what, f, ms = 60000) {
  const until = Date.now() + ms;
  for (;;) {
    const got = await f();
    if (got) return got;
    if (Date.now() > until) throw new Error(`${what}: not within ${ms} ms`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

/** Whether `inner`'s box lies within `outer`'s (both selectors, in the page). */
async function inside(page, inner, outer) {
  return page.evaluate(([i, o]) => {
    const a = document.querySelector(i)?.getBoundingClientRect();
    const b = document.querySelector(o)?.getBoundingClientRect();
    if (!a || !b) return `missing ${a ? o : i}`;
    const ok = a.left >= b.left - 0.5 && a.right <= b.right + 0.5 && a.top >= b.top - 0.5 && a.bottom <= b.bottom + 0.5;
    return ok ? "" : `${i} at ${JSON.stringify(a)} is outside ${o} at ${JSON.stringify(b)}`;
  }, [inner, outer]);
}

const range = (page) => page.textContent("#dl-range");

try {
  for (const width of [1280, 1920]) {
    const page = await browser.newPage({ viewport: { width, height: 1000 } });
    page.on("pageerror", (e) => console.log("PAGEERROR " + e.message));
    await page.goto(url);
    await page.waitForSelector("#login:not([hidden])");
    const said = (await page.textContent("#loginerr")).trim();
    check(said === "", `before any token the login says: ${said}`);
    await page.fill("#token", token);
    await page.click("#signin");
    await page.waitForSelector("#app:not([hidden])");
    await page.waitForSelector(`[data-canary="${handler}"]`, { timeout: 60000 });
    await page.waitForSelector("#dead tbody tr[data-id]");

    const widest = await page.evaluate(() => document.documentElement.scrollWidth);
    check(widest <= width, `the page is ${widest} px wide in a ${width} px window`);
    const overflowing = await page.$$eval("section", (ss) =>
      ss.filter((s) => s.scrollWidth > s.clientWidth + 1).map((s) => `${s.id || s.querySelector("h2")?.textContent.trim()} (${s.scrollWidth} > ${s.clientWidth})`));
    check(overflowing.length === 0, `wider than their card: ${overflowing.join(", ")}`);
    const row = `#handlers tbody tr:has(button[data-promote="${handler}"])`;
    for (const b of [`button[data-promote="${handler}"]`, `button[data-rollback="${handler}"]`]) {
      const why = await inside(page, `${row} ${b}`, row);
      check(why === "", why);
    }
    check((await inside(page, row, "#handlers-section")) === "", "the handler's row leaves its card");

    // One page of 50, then the next.
    const rows = (await page.$$("#dead tbody tr[data-id]")).length;
    check(rows === 50, `${rows} dead-letter rows on the first page`);
    const first = await range(page);
    check(/^1–50 of \d+$/.test(first), `the first page says ${first}`);
    const firstOnFirst = Number(await page.textContent("#dead tbody tr[data-id] td.num"));
    await page.click("#dl-next");
    await waitFor("the second page", async () => (await range(page)).startsWith("51–"));
    const firstOnSecond = Number(await page.textContent("#dead tbody tr[data-id] td.num"));
    check(firstOnSecond === firstOnFirst + 50, `the second page starts at #${firstOnSecond}, the first at #${firstOnFirst}`);
    await page.click("#dl-prev");
    await waitFor("back on the first page", async () => (await range(page)).startsWith("1–"));

    // The reason filter: the three rejected letters, one page, no pager.
    await page.selectOption("#dl-reason", "rejected");
    await waitFor("the rejected letters alone", async () =>
      (await page.$$eval("#dead tbody tr[data-id] .pill", (ps) => ps.map((p) => p.textContent))).join() === "rejected,rejected,rejected");
    check(await page.$eval("#dl-pager", (p) => p.hidden), "a pager under three letters");
    await page.selectOption("#dl-reason", "");
    await waitFor("every letter again", async () => (await page.$$("#dead tbody tr[data-id]")).length === 50);

    // Two refreshes, so the rates have a line to draw, then the picture.
    for (let i = 0; i < 2; i++) {
      const seen = await page.evaluate(() => document.body.dataset.refreshed);
      await waitFor("a refresh", async () => (await page.evaluate(() => document.body.dataset.refreshed)) !== seen);
    }
    // The window, as a person first sees it: rates, slots, handlers, the newest dead letters.
    await page.screenshot({ path: `${dir}/dashboard-${width}.png` });
    console.log(`LAYOUT ${width} ok`);
    await page.close();
  }
} catch (e) {
  console.log("FAIL " + e.message);
  process.exitCode = 1;
} finally {
  await browser.close();
}
