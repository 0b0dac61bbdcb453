// Oracle: the `tiktoken` npm package (OpenAI's tiktoken core, Rust compiled to WASM).
//
//   node tiktoken_oracle.js NODE_MODULES ENCODING CORPUS OUT
//     CORPUS: records (uint32 LE length + bytes), decoded as UTF-8 the way Node does. Each is
//     encoded with every special token allowed (encode(text, "all")). OUT: per record uint32
//     count + int32 ids, then uint32 length + the bytes of decode(ids).
'use strict';
const fs = require('fs');
const path = require('path');

const [nodeModules, encodingName, inPath, outPath] = process.argv.slice(2);
const { get_encoding } = require(path.resolve(nodeModules, 'tiktoken'));

const enc = get_encoding(encodingName);
const input = fs.readFileSync(inPath);
const out = [];
const u32 = (n) => {
  const b = Buffer.alloc(4);
  b.writeUInt32LE(n);
  return b;
};
let pos = 0;
while (pos < input.length) {
  const len = input.readUInt32LE(pos);
  const text = input.subarray(pos + 4, pos + 4 + len).toString('utf8');
  pos += 4 + len;
  const ids = enc.encode(text, 'all');
  const idBuf = Buffer.alloc(4 * ids.length);
  ids.forEach((id, i) => idBuf.writeInt32LE(id, 4 * i));
  const bytes = Buffer.from(enc.decode(ids));
  out.push(u32(ids.length), idBuf, u32(bytes.length), bytes);
}
enc.free();
fs.writeFileSync(outPath, Buffer.concat(out));
