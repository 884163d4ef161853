// The dashboard with a tenant's token, for host/tests/dashboard.rs:
//   node dashboard-tenant.mjs URL TOKEN
// prints "TENANT read-only" when the page opens, says it is read-only, and
// offers no action (no redrive, no rollback); "FAIL <why>" and exit 1 otherwise.
import { chromium } from "playwright-core";

const [url, token] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.WEIR_CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"],
});
try {
  const page = await browser.newPage();
  await page.goto(url);
  await page.waitForSelector("#login:not([hidden])");
  await page.fill("#token", token);
  await page.click("#signin");
  await page.waitForSelector("#app:not([hidden])");
  await page.waitForFunction(() => document.body.dataset.refreshed);
  const who = await page.textContent("#who");
  if (!who.includes("read-only")) throw new Error("the header says " + JSON.stringify(who));
  const actions = await page.$$("button[data-redrive], button[data-rollback], #dl-redrive-all:not([hidden])");
  if (actions.length) throw new Error(`${actions.length} action button(s) shown to a tenant`);
  console.log("TENANT read-only");
} catch (e) {
  console.log("FAIL " + e.message);
  process.exitCode = 1;
} finally {
  await browser.close();
}
