// Run the toy engine's wasm32 build under Node (>= 18, no npm packages):
//
//   node run.mjs ENGINE.wasm MODEL.gguf GOLDEN_DIR OUT.npz [BUG]
//
// ENGINE.wasm is `cargo build -p toy-engine --lib --target wasm32-unknown-unknown --release`'s
// target/wasm32-unknown-unknown/release/toy_engine.wasm. The model and the golden's
// manifest.json are copied into the module's memory, `trace` runs the engine with
// parity-trace's in-memory writer, and the `.npz` it hands back is written to OUT.npz for
// `parity diff GOLDEN_DIR OUT.npz`. On an error the engine's message is printed, exit 1.

import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";

const [wasmPath, modelPath, goldenDir, outPath, bug = ""] = process.argv.slice(2);
if (!outPath || process.argv.length > 7) {
  console.error("usage: node run.mjs ENGINE.wasm MODEL.gguf GOLDEN_DIR OUT.npz [BUG]");
  process.exit(2);
}

function fail(msg) {
  console.error(`run.mjs: ${msg}`);
  process.exit(1);
}

let instance;
try {
  const module = new WebAssembly.Module(readFileSync(wasmPath));
  const imports = WebAssembly.Module.imports(module);
  if (imports.length > 0) {
    fail(`${wasmPath} imports ${imports.map((i) => `${i.module}.${i.name}`).join(", ")} (expected none)`);
  }
  instance = new WebAssembly.Instance(module, {});
} catch (e) {
  fail(`${wasmPath}: ${e.message}`);
}
const x = instance.exports;
for (const f of ["memory", "alloc", "dealloc", "trace", "result_ptr", "result_len"]) {
  if (!(f in x)) fail(`${wasmPath} does not export ${f}`);
}

// Copy bytes into a fresh buffer of the module; returns [ptr, len]. The memory may grow on
// every call into the module, so a view of it is taken only right before it is used.
function copyIn(bytes) {
  if (bytes.length === 0) return [0, 0];
  const ptr = x.alloc(bytes.length) >>> 0; // wasm32 pointers are unsigned
  if (ptr === 0) fail(`cannot allocate ${bytes.length} bytes in the module`);
  new Uint8Array(x.memory.buffer, ptr, bytes.length).set(bytes);
  return [ptr, bytes.length];
}

let gguf, manifest;
try {
  gguf = readFileSync(modelPath);
  manifest = readFileSync(join(goldenDir, "manifest.json"));
} catch (e) {
  fail(e.message);
}
const bufs = [copyIn(gguf), copyIn(manifest), copyIn(new TextEncoder().encode(bug))];

let code;
try {
  code = x.trace(...bufs.flat());
} catch (e) {
  fail(`the engine trapped: ${e.message}`);
}
for (const [ptr, len] of bufs) if (len > 0) x.dealloc(ptr, len);
const result = new Uint8Array(x.memory.buffer, x.result_ptr() >>> 0, x.result_len() >>> 0).slice();
if (code !== 0) fail(new TextDecoder().decode(result));
try {
  writeFileSync(outPath, result);
} catch (e) {
  fail(e.message);
}
console.log(`wrote ${outPath}: ${result.length} bytes`);
