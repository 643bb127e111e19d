#!/usr/bin/env node
// Bundles the example chat page (examples/ai-sdk-chat/chat.jsx: React 19 + useChat), which the
// browser tests drive, into dist/chat.js, and writes
// dist/chat.html that loads it. The Rust browser tests serve dist/ from their own little HTTP
// server, on another port than the node's. Run by .ci/test-prerequisites after `npm ci`; no
// network needed.

import { mkdir, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { build } from 'esbuild';

const here = dirname(fileURLToPath(import.meta.url));
const dist = join(here, 'dist');
await mkdir(dist, { recursive: true });

await build({
    entryPoints: [join(here, '..', '..', 'examples', 'ai-sdk-chat', 'chat.jsx')],
    // The example has no node_modules of its own: it builds with the tests' packages.
    nodePaths: [join(here, 'node_modules')],
    outfile: join(dist, 'chat.js'),
    bundle: true,
    platform: 'browser',
    // A classic script (IIFE) rather than an ES module: loaded by a plain <script src>, it needs no
    // module MIME type or CORS from the test's file server.
    format: 'iife',
    target: 'es2022',
    // React 19's automatic runtime: the page imports no React just for JSX.
    jsx: 'automatic',
    // Readable as it is when a test fails and someone opens the bundle (so no source map).
    minify: false,
    // React picks its production build from this; a browser has no `process`.
    define: { 'process.env.NODE_ENV': '"production"' },
    logLevel: 'warning',
});

await writeFile(
    join(dist, 'chat.html'),
    `<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>converger: useChat test page</title>
</head>
<body>
<div id="root"></div>
<script src="chat.js"></script>
</body>
</html>
`,
);
