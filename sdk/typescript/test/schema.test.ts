// The frame types are the schemas': src/schema.ts is exactly what the generator makes now.

import assert from "node:assert/strict";
import { readFile } from "node:fs/promises";
import path from "node:path";
import { test } from "node:test";
import { pathToFileURL } from "node:url";
import { PACKAGE_DIR } from "./support.js";

interface Generator {
    generateSchemaTypes(): Promise<string>;
}

function isGenerator(value: unknown): value is Generator {
    return typeof value === "object" && value !== null && "generateSchemaTypes" in value;
}

test("src/schema.ts is what scripts/generate-types.mjs generates from the schemas", async () => {
    const script = pathToFileURL(path.join(PACKAGE_DIR, "scripts/generate-types.mjs")).href;
    const generator: unknown = await import(script);
    assert.ok(isGenerator(generator), "the script exports generateSchemaTypes");
    const generated = await generator.generateSchemaTypes();
    const committed = await readFile(path.join(PACKAGE_DIR, "src/schema.ts"), "utf8");
    assert.equal(committed, generated, "run `npm run generate` and commit src/schema.ts");
});
