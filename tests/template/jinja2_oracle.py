#!/usr/bin/python3
"""Oracle: renders chat templates with Python jinja2 exactly as Hugging Face's apply_chat_template
sets it up (transformers.utils.chat_template_utils._compile_jinja_template): an
ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and the loopcontrols extension,
tojson overridden by json.dumps(ensure_ascii=False, ...), and the raise_exception and
strftime_now globals.

Usage: jinja2_oracle.py CASES_JSON OUT_JSON
  CASES_JSON: [{"template": "<source>", "context": {...}}, ...]
  OUT_JSON:   [{"ok": true, "output": "..."} or {"ok": false, "error": "..."}, ...]
"""
import json
import sys
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


def main():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters['tojson'] = tojson
    env.globals['raise_exception'] = raise_exception
    env.globals['strftime_now'] = strftime_now
    with open(sys.argv[1], encoding='utf-8') as f:
        cases = json.load(f)
    compiled = {}
    results = []
    for case in cases:
        try:
            source = case['template']
            if source not in compiled:
                compiled[source] = env.from_string(source)
            results.append({'ok': True, 'output': compiled[source].render(**case['context'])})
        except Exception as e:  # the C++ side must fail on the same cases
            results.append({'ok': False, 'error': '%s: %s' % (type(e).__name__, e)})
    with open(sys.argv[2], 'w', encoding='utf-8') as f:
        json.dump(results, f, ensure_ascii=False)


if __name__ == '__main__':
    main()
