// Writes a tiktoken encoding shipped inside the npm `tiktoken` package as a model folder in the
// form Kimi's checkpoints use: tiktoken.model ("<base64 bytes> <rank>" per line) and a
// tokenizer_config.json carrying pat_str and the special tokens (added_tokens_decoder).
//
//   node export_tiktoken_encoding.js NODE_MODULES ENCODING OUT_DIR
'use strict';
const fs = require('fs');
const path = require('path');

const [nodeModules, name, outDir] = process.argv.slice(2);
const encoding = require(path.resolve(nodeModules, 'tiktoken', 'encoders', name + '.json'));

// The package stores ranks compactly: lines of "! <first rank> <base64> <base64> ...", ranks
// consecutive from <first rank>; other lines are "<base64> <rank>".
const lines = [];
for (const line of encoding.bpe_ranks.split('\n')) {
  if (!line) continue;
  const fields = line.split(' ');
  if (fields[0] === '!') {
    let rank = Number(fields[1]);
    for (const token of fields.slice(2)) lines.push(token + ' ' + rank++);
  } else {
    lines.push(fields[0] + ' ' + Number(fields[1]));
  }
}

const added = {};
for (const [content, id] of Object.entries(encoding.special_tokens)) {
  added[String(id)] = { content, special: true };
}
fs.mkdirSync(outDir, { recursive: true });
fs.writeFileSync(path.join(outDir, 'tiktoken.model'), lines.join('\n') + '\n');
fs.writeFileSync(
  path.join(outDir, 'tokenizer_config.json'),
  JSON.stringify({ pat_str: encoding.pat_str, added_tokens_decoder: added }, null, 2) + '\n');
console.log(`export_tiktoken_encoding: ${name}: ${lines.length} ranks, ` +
            `${Object.keys(added).length} special tokens -> ${outDir}`);
