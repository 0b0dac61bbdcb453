// Single-threaded encode throughput of Hugging Face `tokenizers` (Rust, Node binding) on the same
// corpus file as tokenizer_bench. One encode in flight at a time, so one Rust thread works.
//
//   node hf_tokenizers_bench.js NODE_MODULES TOKENIZER_JSON CORPUS [PASSES]
'use strict';
const fs = require('fs');
const path = require('path');

const [nodeModules, tokenizerJson, corpusPath, passesArg] = process.argv.slice(2);
const { Tokenizer } = require(path.resolve(nodeModules, 'tokenizers'));
const passes = Number(passesArg || 3);

async function main() {
  const tok = Tokenizer.fromFile(tokenizerJson);
  const data = fs.readFileSync(corpusPath);
  const texts = [];
  let total = 0;
  for (let pos = 0; pos + 4 <= data.length;) {
    const len = data.readUInt32LE(pos);
    texts.push(data.subarray(pos + 4, pos + 4 + len).toString('utf8'));
    total += len;
    pos += 4 + len;
  }
  let best = Infinity;
  let tokens = 0;
  for (let p = 0; p < passes; ++p) {
    tokens = 0;
    const start = process.hrtime.bigint();
    for (const text of texts) tokens += (await tok.encode(text, null, { addSpecialTokens: false })).getIds().length;
    best = Math.min(best, Number(process.hrtime.bigint() - start) / 1e9);
  }
  console.log(`hf-tokenizers: ${texts.length} records, ${(total / 1e6).toFixed(2)} MB, ${tokens} tokens, ` +
              `best of ${passes} passes ${best.toFixed(3)} s, ${(total / 1e6 / best).toFixed(2)} MB/s`);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
