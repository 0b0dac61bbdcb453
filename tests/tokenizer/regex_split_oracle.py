#!/usr/bin/python3
"""Oracle: pre-tokenizer split of a pattern by Python's `regex` module (Debian python3-regex).

Usage: regex_split_oracle.py PATTERN_FILE CORPUS OUT
  CORPUS: records (uint32 LE length + bytes), decoded as UTF-8 with errors="replace" (maximal
  subparts -> U+FFFD, as our tokenizer reads ill-formed input). OUT: per record uint32 count and
  int32 (begin, end) UTF-8 byte offsets of every match, in order (the pieces tiktoken encodes).
The pattern is compiled with regex.V1: class set operations such as Kimi's [A&&[^\\p{Han}]] are
version-1 syntax (version 0 reads them as a plain class and silently matches something else).
"""
import struct
import sys

import regex


def main():
    with open(sys.argv[1], encoding='utf-8') as f:
        pattern = regex.compile(f.read(), regex.V1)
    data = open(sys.argv[2], 'rb').read()
    out = []
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack_from('<I', data, pos)
        text = data[pos + 4:pos + 4 + length].decode('utf-8', errors='replace')
        pos += 4 + length
        offsets = []
        byte_pos, char_pos = 0, 0
        for m in pattern.finditer(text):
            # Convert code point offsets to UTF-8 byte offsets incrementally.
            byte_pos += len(text[char_pos:m.start()].encode('utf-8'))
            begin = byte_pos
            byte_pos += len(m.group().encode('utf-8'))
            char_pos = m.end()
            offsets += [begin, byte_pos]
        out.append(struct.pack('<I', len(offsets)))
        out.append(struct.pack('<%di' % len(offsets), *offsets))
    with open(sys.argv[3], 'wb') as f:
        f.write(b''.join(out))


if __name__ == '__main__':
    main()
