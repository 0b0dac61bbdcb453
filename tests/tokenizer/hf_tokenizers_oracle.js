// Oracle: Hugging Face `tokenizers` (Rust, Node binding) on a tokenizer.json.
//
//   node hf_tokenizers_oracle.js NODE_MODULES TOKENIZER_JSON encode CORPUS OUT
//     CORPUS: records (uint32 LE length + bytes). Each record is decoded as UTF-8 the way Node
//     does (ill-formed sequences -> U+FFFD) and encoded without special tokens. OUT: per record
//     uint32 count + int32 ids, then uint32 length + bytes of decode(ids, skip=false), then
//     uint32 length + bytes of decode(ids, skip=true).
//   node hf_tokenizers_oracle.js NODE_MODULES TOKENIZER_JSON encode_special CORPUS OUT
//     As encode, with addSpecialTokens: true (the post_processor's template applies).
//   node hf_tokenizers_oracle.js NODE_MODULES TOKENIZER_JSON decode IDS OUT
//     IDS: records of uint32 count + int32 ids. OUT: per record decode(skip=false) and
//     decode(skip=true), each as uint32 length + bytes.
'use strict';
const fs = require('fs');
const path = require('path');

const [nodeModules, tokenizerJson, mode, inPath, outPath] = process.argv.slice(2);
const { Tokenizer } = require(path.resolve(nodeModules, 'tokenizers'));

function u32(n) {
  const b = Buffer.alloc(4);
  b.writeUInt32LE(n);
  return b;
}
function withLength(buf) {
  return [u32(buf.length), buf];
}

async function main() {
  const tok = Tokenizer.fromFile(tokenizerJson);
  const input = fs.readFileSync(inPath);
  const out = [];
  let pos = 0;
  while (pos < input.length) {
    if (mode === 'encode' || mode === 'encode_special') {
      const len = input.readUInt32LE(pos);
      const text = input.subarray(pos + 4, pos + 4 + len).toString('utf8');
      pos += 4 + len;
      const ids = (await tok.encode(text, null, { addSpecialTokens: mode === 'encode_special' })).getIds();
      const idBuf = Buffer.alloc(4 * ids.length);
      ids.forEach((id, i) => idBuf.writeInt32LE(id, 4 * i));
      out.push(u32(ids.length), idBuf);
      out.push(...withLength(Buffer.from(await tok.decode(ids, false), 'utf8')));
      out.push(...withLength(Buffer.from(await tok.decode(ids, true), 'utf8')));
    } else if (mode === 'decode') {
      const count = input.readUInt32LE(pos);
      const ids = [];
      for (let i = 0; i < count; ++i) ids.push(input.readInt32LE(pos + 4 + 4 * i));
      pos += 4 + 4 * count;
      out.push(...withLength(Buffer.from(await tok.decode(ids, false), 'utf8')));
      out.push(...withLength(Buffer.from(await tok.decode(ids, true), 'utf8')));
    } else {
      throw new Error('mode must be encode or decode, got ' + mode);
    }
  }
  fs.writeFileSync(outPath, Buffer.concat(out));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
