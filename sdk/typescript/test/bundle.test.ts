// The demo page's copy of the SDK (crates/gateway/src/routes/demo-converger.js, embedded in the
// node and served as /demo/converger.js) must be the build of these sources: the browser test of
// the demo page (tests/demo_page.rs) then exercises this code, not an older one.

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

// Compiled to build/test/, two levels below the package root.
const packageRoot = join(dirname(fileURLToPath(import.meta.url)), "..", "..");

test("the demo page's bundle is the current build of the SDK", () => {
    const checked = spawnSync(
        process.execPath,
        [join(packageRoot, "scripts", "bundle-demo.mjs"), "--check"],
        {
            encoding: "utf8",
            timeout: 60_000,
        },
    );
    assert.equal(checked.status, 0, `${checked.stdout}${checked.stderr}`);
});
