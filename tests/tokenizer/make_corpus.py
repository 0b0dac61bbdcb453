#!/usr/bin/python3
"""Builds the tokenizer test corpus: real text found on this machine plus adversarial cases.

Output: a file of records, each a little-endian uint32 byte length followed by the bytes (not
necessarily valid UTF-8: some adversarial records are ill-formed on purpose). Deterministic for
a given machine: files are taken in sorted order, random cases use fixed seeds.

Usage: make_corpus.py OUT [--budget-bytes N] [--vocab tokenizer.json]
"""
import argparse
import glob
import gzip
import json
import os
import random
import struct
import unicodedata

CHUNK_BYTES = 16 * 1024


def read_text_file(path):
    try:
        with open(path, 'rb') as f:
            data = f.read()
        if path.endswith('.gz'):
            data = gzip.decompress(data)
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if b'\0' in data:
        return None  # binary
    return data


def chunks(data):
    """Cuts at line ends into pieces of at most CHUNK_BYTES (a line longer than that stays whole)."""
    out, start = [], 0
    while start < len(data):
        end = start + CHUNK_BYTES
        if end >= len(data):
            out.append(data[start:])
            break
        cut = data.rfind(b'\n', start, end)
        if cut <= start:
            cut = data.find(b'\n', end)
            if cut < 0:
                cut = len(data) - 1
        out.append(data[start:cut + 1])
        start = cut + 1
    return out


def real_text(budget):
    """(category, glob, share of budget): licences, man pages in several languages, source, docs."""
    sources = [
        ('licences', ['/usr/share/common-licenses/*'], 0.10),
        ('man-en', ['/usr/share/man/man1/*.gz'], 0.10),
        ('man-l10n', ['/usr/share/man/%s/man*/*.gz' % lang for lang in
                      ('de', 'fr', 'es', 'it', 'pl', 'ru', 'ja', 'ko', 'pt_BR', 'sv', 'cs', 'tr',
                       'uk', 'zh_CN', 'zh_TW', 'nl', 'fi', 'hu', 'ro', 'sr', 'da', 'id')], 0.35),
        ('copyright', ['/usr/share/doc/*/copyright'], 0.10),
        ('c-headers', ['/usr/include/*.h', '/usr/include/*/*.h'], 0.10),
        ('python', ['/usr/lib/python3*/*.py'], 0.15),
        ('markdown', ['/usr/share/doc/*/*.md', '/usr/share/doc/*/README*'], 0.10),
    ]
    records = []
    for _, patterns, share in sources:
        paths = sorted(set(p for pattern in patterns for p in glob.glob(pattern)))
        # Round-robin over languages for man pages: one file from each folder in turn.
        by_dir = {}
        for p in paths:
            by_dir.setdefault(os.path.dirname(p), []).append(p)
        ordered = []
        while any(by_dir.values()):
            for d in sorted(by_dir):
                if by_dir[d]:
                    ordered.append(by_dir[d].pop(0))
        left = int(budget * share)
        for p in ordered:
            if left <= 0:
                break
            if not os.path.isfile(p):
                continue
            data = read_text_file(p)
            if not data:
                continue
            data = data[:left]
            records.extend(chunks(data))
            left -= len(data)
    return records


def adversarial(vocab_path):
    s = []
    u = lambda text: text.encode('utf-8', 'surrogatepass')
    # Whitespace runs, alone and between words (\s+(?!\S) and the long-piece BPE path).
    s += [u(' ' * 10000), u('\n' * 3000), u('\t' * 999 + 'x'), u('a' + ' ' * 1000 + 'b'),
          u(' \n' * 700), u('\r\n' * 500 + 'end'), u('x' + '\u3000' * 64 + '\u00a0' * 7 + 'y'),
          u('  \t \n\n  word   \n'), u('a' * 5000), u('ab' * 3000), u('.' * 4000), u('!?' * 1500),
          u('\u2028\u2029\u0085\u180e\u200b\ufeff\u2060 mixed \u000b\u000c separators')]
    # Ill-formed UTF-8: stray continuation bytes, truncated sequences, overlongs, CESU-8 lone
    # surrogates, bytes above U+10FFFF.
    s += [b'\xff\xfe plain \xc3\x28 \xe2\x82 \xf0\x9f\x98 end', b'\xed\xa0\x80 lone surrogate \xed\xbf\xbf',
          b'\xc0\xaf overlong \xe0\x80\xaf', b'\xf4\x90\x80\x80 above max', b'\x80\x81\x82\xbf',
          b'tail cut \xe4\xbd', b'\xf0\x9f\x91\xa9\xe2\x80', u('ok') + b'\xc2' + u('next')]
    # Lone surrogates as a str would carry them (written as CESU-8 bytes above), and emoji.
    s += [u('👩‍👩‍👧‍👦 family, 👨🏽‍💻 coder, 🏳️‍🌈 flag, 🇯🇵🇫🇷 flags, 1️⃣ keycap, ❤️‍🔥'),
          u('🙂' * 300), u('Text with emoji😀inside😀words and 🤌🏾 modifiers.')]
    # CJK and other scripts.
    s += [u('大型语言模型的分词器必须与训练时完全一致，否则每个回答都会有细微的错误。'),
          u('日本語のテキスト：ひらがな、カタカナ、漢字が混ざっています。ｶﾀｶﾅ半角も。'),
          u('한국어 문장은 공백으로 단어를 구분합니다. 토크나이저 테스트!'),
          u('中文English混合123数字４５６全角，标点。「引号」《书名》'),
          u('Ελληνικά κείμενα, русский текст, עברית, العربية مع تشكيل: مُحَمَّد'),
          u('हिन्दी देवनागरी, ภาษาไทย ไม่มีช่องว่าง, ქართული, Tiếng Việt có dấu'),
          u('e\u0301 cafe\u0301 n\u0303 combining\u0308\u0308\u0308 marks Z\u0351\u0308\u0344')]
    # Digit runs of every length and other numeric characters.
    s += [u('1234567890' * 50), u(' '.join(str(10 ** k) for k in range(40))), u('3.14159265358979323846'),
          u('٠١٢٣٤٥٦٧٨٩ ۰۱۲ १२३ ①②③ ²³¹ Ⅻ ½¾ １２３４５'), u('v1.2.3-rc4+build.567 0x1F 1e-10 -42')]
    # Contractions and case folding around (?i:'s|...).
    s += [u("I'll, you're, they've, he'd, she's, it'S, WE'LL, DON'T, O'Neil's, rock'n'roll, 'ſ 'K")]
    # Special tokens written in text (DeepSeek, o200k, Kimi), alone, adjacent, partial.
    s += [u('<｜begin▁of▁sentence｜>Hello<｜end▁of▁sentence｜>'),
          u('<｜User｜>hi<｜Assistant｜><think>\nreasoning</think>answer<｜end▁of▁sentence｜>'),
          u('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
          u('partial <｜begin▁of▁sent and <｜end▁of▁sentence｜<｜end▁of▁sentence｜>>'),
          u('<|endoftext|>plain<|endofprompt|> <|endoftext|><|endoftext|>'),
          u('<|im_user|>user<|im_middle|>text<|im_end|><|im_assistant|>')]
    # Code and markup.
    s += [u('def f(x):\n\tif x:\n\t\treturn {"a": [1, 2, 3]}  # comment\n\n\n    pass\n'),
          u('<div class="x">&amp;&lt;tag&gt;</div>\n<!-- c -->'), u('$ ls -la | grep "\\.py$" >> out.txt 2>&1')]
    # Random code points from several planes (seeded), and random ASCII soup. Only code points
    # assigned in this Python's Unicode database (Debian 12: Unicode 14, the version of its
    # PCRE2 tables too) are drawn: letters added by later Unicode versions are classified
    # differently by engines with newer tables (tiktoken's Rust regex), a known, documented gap.
    rng = random.Random(8)
    ranges = [(0x20, 0x7e), (0xa0, 0x2fff), (0x3000, 0x9fff), (0xac00, 0xd7a3), (0xf900, 0xfffd),
              (0x10000, 0x1faff), (0x20000, 0x2a6df)]
    for _ in range(200):
        chars = []
        for _ in range(rng.randint(1, 60)):
            lo, hi = rng.choice(ranges)
            c = chr(rng.randint(lo, hi))
            while unicodedata.category(c) == 'Cn':
                c = chr(rng.randint(lo, hi))
            chars.append(c)
        s.append(u(''.join(chars)))
    for _ in range(100):
        s.append(u(''.join(rng.choice(' \t\n\r!"#$%&\'()*+,-./0123456789:;<=>?@AZaz[\\]^_`{|}~éß中ー')
                           for _ in range(rng.randint(1, 200)))))
    # Random vocabulary tokens glued together: CJK-heavy pseudo-text that exercises merges.
    if vocab_path:
        with open(vocab_path, encoding='utf-8') as f:
            vocab = json.load(f)['model']['vocab']
        byte_decoder = _byte_decoder()
        pieces = []
        for token in sorted(vocab):
            try:
                pieces.append(bytes(byte_decoder[c] for c in token).decode('utf-8'))
            except (KeyError, UnicodeDecodeError):
                pass
        cjk = [p for p in pieces if any('\u4e00' <= c <= '\u9fff' for c in p)]
        for _ in range(100):
            s.append(u(''.join(rng.choice(cjk) for _ in range(rng.randint(5, 80)))))
        for _ in range(100):
            s.append(u(''.join(rng.choice(pieces) for _ in range(rng.randint(5, 80)))))
    return s


def _byte_decoder():
    bs = list(range(ord('!'), ord('~') + 1)) + list(range(0xa1, 0xac + 1)) + list(range(0xae, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('out')
    parser.add_argument('--budget-bytes', type=int, default=3 * 1024 * 1024)
    parser.add_argument('--vocab', help='tokenizer.json whose vocabulary seeds pseudo-text')
    parser.add_argument('--no-adversarial', action='store_true')
    args = parser.parse_args()
    records = real_text(args.budget_bytes)
    if not args.no_adversarial:
        records += adversarial(args.vocab)
    with open(args.out, 'wb') as f:
        for r in records:
            f.write(struct.pack('<I', len(r)))
            f.write(r)
    print('%d records, %d bytes' % (len(records), sum(len(r) for r in records)))


if __name__ == '__main__':
    main()
