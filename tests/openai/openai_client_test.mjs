// The official `openai` npm client (third_party/npm, pinned in its package.json) against a live
// mlaserve-openai in front of a coordinator + CPU workers on the embedded tiny model. Started by
// openai_server_test.cc with OPENAI_BASE_URL, OPENAI_API_KEY and MLASERVE_NPM_DIR set. Each
// check compares against an independent value: the streamed text against the non-streamed one
// at temperature 0, a stop string's cut against the uncut text, usage against the token counts,
// the sampled token's logprob against the top alternative's under greedy decoding.
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';

const require = createRequire(process.env.MLASERVE_NPM_DIR + '/package.json');
const { default: OpenAI } = require('openai');

const client = new OpenAI({ baseURL: process.env.OPENAI_BASE_URL, apiKey: process.env.OPENAI_API_KEY, maxRetries: 0 });
const messages = [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: [{ type: 'text', text: 'Name three colours.' }] }];
const greedy = { temperature: 0, max_tokens: 16, ignore_eos: true };

let failures = 0;
async function check(name, fn) {
  try {
    await fn();
    console.log(`ok   ${name}`);
  } catch (e) {
    failures++;
    console.log(`FAIL ${name}: ${e.stack || e}`);
  }
}

async function collectChat(params) {
  const stream = await client.chat.completions.create({ ...params, stream: true, stream_options: { include_usage: true } });
  const out = { text: {}, roles: 0, finishes: {}, usage: null, chunks: 0 };
  for await (const chunk of stream) {
    out.chunks++;
    if (chunk.usage) {
      assert.equal(out.usage, null, 'one usage chunk');
      assert.deepEqual(chunk.choices, []);
      out.usage = chunk.usage;
      continue;
    }
    for (const c of chunk.choices) {
      assert.equal(out.finishes[c.index], undefined, `choice ${c.index}: nothing after its finish_reason`);
      if (c.delta.role) {
        assert.equal(out.text[c.index], undefined, 'the role comes with the first chunk only');
        out.roles++;
      }
      out.text[c.index] = (out.text[c.index] ?? '') + (c.delta.content ?? '');
      if (c.finish_reason) out.finishes[c.index] = c.finish_reason;
    }
  }
  return out;
}

const models = await client.models.list();
const model = models.data[0].id;
assert.equal(models.data.length, 1);

let reference;  // the greedy chat text
await check('chat non-streaming, usage', async () => {
  const r = await client.chat.completions.create({ model, messages, ...greedy });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.model, model);
  assert.equal(r.choices.length, 1);
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 16);
  assert.ok(r.usage.prompt_tokens > 5, `prompt_tokens ${r.usage.prompt_tokens}`);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + 16);
  reference = r;
});

await check('chat streaming equals non-streaming at temperature 0', async () => {
  const s = await collectChat({ model, messages, ...greedy });
  assert.equal(s.text[0], reference.choices[0].message.content);
  assert.equal(s.roles, 1);
  assert.deepEqual(s.finishes, { 0: 'length' });
  assert.deepEqual(s.usage.prompt_tokens, reference.usage.prompt_tokens);
  assert.deepEqual(s.usage.completion_tokens, 16);
});

await check('completions non-streaming and streaming', async () => {
  const params = { model, prompt: 'The capital of France is', ...greedy, max_tokens: 12 };
  const r = await client.completions.create(params);
  assert.equal(r.object, 'text_completion');
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 12);
  const stream = await client.completions.create({ ...params, stream: true });
  let text = '', finishes = 0;
  for await (const chunk of stream) {
    for (const c of chunk.choices) {
      text += c.text;
      if (c.finish_reason) finishes++;
    }
  }
  assert.equal(text, r.choices[0].text);
  assert.equal(finishes, 1);
});

await check('n = 2, streamed and not', async () => {
  const params = { model, messages, temperature: 1, seed: 11, max_tokens: 10, ignore_eos: true, n: 2 };
  const r = await client.chat.completions.create(params);
  assert.deepEqual(r.choices.map((c) => c.index), [0, 1]);
  assert.equal(r.usage.completion_tokens, 20);
  const s = await collectChat(params);
  assert.deepEqual(s.finishes, { 0: 'length', 1: 'length' });
  assert.equal(s.roles, 2);
  assert.equal(s.text[0], r.choices[0].message.content);
  assert.equal(s.text[1], r.choices[1].message.content);
  assert.equal(s.usage.completion_tokens, 20);
});

await check('seed reproducibility', async () => {
  const params = { model, messages, temperature: 1, max_tokens: 16, ignore_eos: true };
  const a = await client.chat.completions.create({ ...params, seed: 1234 });
  const b = await client.chat.completions.create({ ...params, seed: 1234 });
  const c = await client.chat.completions.create({ ...params, seed: 99 });
  assert.equal(a.choices[0].message.content, b.choices[0].message.content);
  assert.notEqual(a.choices[0].message.content, c.choices[0].message.content);
});

await check('stop string cuts the greedy text before its first occurrence', async () => {
  const full = reference.choices[0].message.content;
  // A stop string from the middle of the uncut text, not at its very start.
  let at = Math.floor(full.length / 2), stop = full.slice(at, at + 3);
  assert.ok(stop.length > 0, `text too short: ${JSON.stringify(full)}`);
  const first = full.indexOf(stop);
  const r = await client.chat.completions.create({ model, messages, ...greedy, stop: [stop, 'never-in-the-text-zz'] });
  assert.equal(r.choices[0].message.content, full.slice(0, first));
  assert.equal(r.choices[0].finish_reason, 'stop');
});

await check('logprobs shape', async () => {
  const r = await client.chat.completions.create({ model, messages, ...greedy, max_tokens: 8, logprobs: true, top_logprobs: 3 });
  const content = r.choices[0].logprobs.content;
  assert.equal(content.length, 8);
  for (const e of content) {
    assert.equal(typeof e.token, 'string');
    assert.ok(e.logprob <= 0);
    assert.equal(e.top_logprobs.length, 3);
    for (let i = 1; i < 3; i++) assert.ok(e.top_logprobs[i - 1].logprob >= e.top_logprobs[i].logprob);
    // Greedy: the sampled token is the most likely one (f32 values, equal up to rounding).
    assert.ok(Math.abs(e.top_logprobs[0].logprob - e.logprob) < 1e-4, JSON.stringify(e));
  }
  assert.ok(r.choices[0].message.content.startsWith(Buffer.from(content.flatMap((e) => e.bytes)).toString('utf8')));
  const c = await client.completions.create({ model, prompt: 'Hello', ...greedy, max_tokens: 4, logprobs: 2 });
  assert.equal(c.choices[0].logprobs.tokens.length, 4);
  assert.equal(c.choices[0].logprobs.top_logprobs[0] && Object.keys(c.choices[0].logprobs.top_logprobs[0]).length, 2);
});

async function expectStatus(status, fn, param) {
  try {
    await fn();
  } catch (e) {
    assert.equal(e.status, status, String(e));
    assert.ok(e.error && typeof e.error.message === 'string', JSON.stringify(e.error));
    if (param !== undefined) assert.equal(e.error.param, param);
    return;
  }
  assert.fail(`expected HTTP ${status}`);
}

// The server root (the extension endpoints are not under /v1).
const root = process.env.OPENAI_BASE_URL.replace(/\/v1\/?$/, '');
async function post(path, body) {
  const r = await fetch(root + path, {
    method: 'POST', body: JSON.stringify(body),
    headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${process.env.OPENAI_API_KEY}` },
  });
  return { status: r.status, body: await r.json() };
}

await check('/version', async () => {
  const r = await fetch(root + '/version', { headers: { Authorization: `Bearer ${process.env.OPENAI_API_KEY}` } });
  assert.equal(r.status, 200);
  assert.match((await r.json()).version, /^[0-9]+\.[0-9]+\.[0-9]+$/);
});

await check('/tokenize and /detokenize round trip', async () => {
  const text = 'Héllo, wörld — 你好 🙂 x=1+2';
  const t = await post('/tokenize', { prompt: text, add_special_tokens: false });
  assert.equal(t.status, 200, JSON.stringify(t.body));
  assert.equal(t.body.count, t.body.tokens.length);
  assert.ok(t.body.count > 5 && t.body.count < text.length, JSON.stringify(t.body));
  assert.ok(t.body.max_model_len > 0);
  const d = await post('/detokenize', { tokens: t.body.tokens });
  assert.equal(d.status, 200);
  assert.equal(d.body.prompt, text);
  // With BOS: one more token, written out by /detokenize.
  const b = await post('/tokenize', { prompt: text });
  assert.deepEqual(b.body.tokens.slice(1), t.body.tokens);
  assert.equal((await post('/detokenize', { tokens: b.body.tokens })).body.prompt, '<｜begin▁of▁sentence｜>' + text);
  // A chat's count is the coordinator's prompt_tokens for it.
  const m = await post('/tokenize', { messages });
  assert.equal(m.body.count, reference.usage.prompt_tokens);
  const bad = await post('/detokenize', { tokens: [-1] });
  assert.equal(bad.status, 400);
  assert.equal(bad.body.error.param, 'tokens');
});

await check('logprobs carry each token\'s own string and bytes', async () => {
  const r = await client.chat.completions.create({ model, messages, ...greedy, logprobs: true, top_logprobs: 2, skip_special_tokens: false });
  const content = r.choices[0].logprobs.content;
  assert.equal(content.length, 16);
  // The tokens' bytes, concatenated, are the text (each token decoded alone, by the tokenizer).
  const bytes = Buffer.from(content.flatMap((e) => e.bytes));
  assert.equal(bytes.toString('utf8'), r.choices[0].message.content);
  for (const e of content) {
    const own = Buffer.from(e.bytes).toString('utf8');
    if (!own.includes('\ufffd')) assert.equal(e.token, own, JSON.stringify(e));
    // Greedy: the top alternative is the sampled token, named alike.
    assert.equal(e.top_logprobs[0].token, e.token);
    assert.ok(!e.top_logprobs[1].token.startsWith('token_id:'), JSON.stringify(e));
  }
});

const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather in a city', parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } } }];
await check('tools accepted; tool_choice none and auto', async () => {
  // The embedded model's random weights emit no tool-call markers: the parsed output (decoded
  // here from the token ids) must be the coordinator's own text, streamed or not.
  const auto = await client.chat.completions.create({ model, messages, ...greedy, tools, tool_choice: 'auto' });
  assert.equal(auto.choices[0].message.content, reference.choices[0].message.content);
  assert.equal(auto.choices[0].finish_reason, 'length');
  assert.equal(auto.choices[0].message.tool_calls, undefined);
  // The coordinator rendered the tools through the chat template, as /tokenize does (DeepSeek-V3's
  // template writes no tools into the prompt, so the counts also equal the tool-less ones).
  const t = await post('/tokenize', { messages, tools });
  assert.equal(auto.usage.prompt_tokens, t.body.count);
  const s = await collectChat({ model, messages, ...greedy, tools });
  assert.equal(s.text[0], reference.choices[0].message.content);
  assert.deepEqual(s.finishes, { 0: 'length' });
  const none = await client.chat.completions.create({ model, messages, ...greedy, tools, tool_choice: 'none' });
  assert.equal(none.choices[0].message.content, reference.choices[0].message.content);
  await expectStatus(400, () => client.chat.completions.create({ model, messages, tools: [{ type: 'function' }] }), 'tools[0]');
  // Stop strings with tools: matched in the front end on the answer's content (two characters
  // from the middle of the reference answer; the content ends before their first occurrence).
  const ref = reference.choices[0].message.content;
  const chars = [...ref];
  const stop = chars.slice(Math.floor(chars.length / 2), Math.floor(chars.length / 2) + 2).join('');
  const cut = await client.chat.completions.create({ model, messages, ...greedy, tools, stop: [stop] });
  assert.equal(cut.choices[0].message.content, ref.slice(0, ref.indexOf(stop)));
  assert.equal(cut.choices[0].finish_reason, 'stop');
});

// tool_choice "required" / named: the prompt ends with the opening of a call in DeepSeek-V3's
// markers (coordinator/http/chat_prompt.h), so even the random tiny model answers with a call to
// the function; its arguments are whatever the model writes (not constrained).
const tools2 = [...tools, { type: 'function', function: { name: 'get_time', parameters: { type: 'object', properties: {} } } }];
const named = { type: 'function', function: { name: 'get_time' } };
let forcedCall;  // the named call, for the round trip
await check('tool_choice named and required force a call', async () => {
  const r = await client.chat.completions.create({ model, messages, ...greedy, tools: tools2, tool_choice: named });
  const m = r.choices[0].message;
  assert.equal(m.tool_calls.length, 1, JSON.stringify(m));
  assert.equal(m.tool_calls[0].type, 'function');
  assert.equal(m.tool_calls[0].function.name, 'get_time');
  assert.match(m.tool_calls[0].id, /^call_/);
  assert.equal(typeof m.tool_calls[0].function.arguments, 'string');
  assert.equal(m.content, null);
  // The random model never closes the call: cut by max_tokens, all 16 tokens in the arguments.
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 16);
  forcedCall = m.tool_calls[0];
  // Streamed: the same call, its name in the first tool-call delta, one finish.
  const stream = await client.chat.completions.create({ model, messages, ...greedy, tools: tools2, tool_choice: named, stream: true });
  let name = '', args = '', id = '', finishes = 0, content = '';
  for await (const chunk of stream) {
    for (const c of chunk.choices) {
      content += c.delta.content ?? '';
      for (const t of c.delta.tool_calls ?? []) {
        assert.equal(t.index, 0);
        if (t.function?.name) { assert.equal(name, '', 'the name comes once'); name = t.function.name; id = t.id; }
        args += t.function?.arguments ?? '';
      }
      if (c.finish_reason) finishes++;
    }
  }
  assert.equal(name, 'get_time');
  assert.equal(args, forcedCall.function.arguments);
  assert.equal(content, '');
  assert.equal(finishes, 1);
  assert.match(id, /^call_/);
  // "required" with one tool can only call that one.
  const one = await client.chat.completions.create({ model, messages, ...greedy, tools, tool_choice: 'required' });
  assert.equal(one.choices[0].message.tool_calls[0].function.name, 'get_weather');
  // "required" with two: the model picks the name, and the random model's is no tool's: an error,
  // not a response that breaks the promise.
  await expectStatus(500, () => client.chat.completions.create({ model, messages, ...greedy, tools: tools2, tool_choice: 'required' }));
  await expectStatus(400, () => client.chat.completions.create({ model, messages, tools, tool_choice: { type: 'function', function: { name: 'nope' } } }), 'tool_choice');
  await expectStatus(400, () => client.chat.completions.create({ model, messages, tool_choice: 'required' }), 'tool_choice');
  await expectStatus(400, () => client.chat.completions.create({ model, messages, tools: [{ type: 'function', function: { name: 'f', strict: true, parameters: {} } }] }), 'tools[0].function.strict');
});

// The conversation after the call goes back through the chat template: the prompt the server
// builds is the one Python jinja2 renders from DeepSeek-V3's template (tests/template's oracle),
// tokenized; the chat request on it reports that many prompt tokens.
await check('tool-call round trip through the chat template', async () => {
  assert.ok(forcedCall, 'needs the named call above');
  const conversation = [...messages,
    { role: 'assistant', content: null, tool_calls: [forcedCall] },
    { role: 'tool', tool_call_id: forcedCall.id, content: '12:00 UTC' },
    { role: 'user', content: 'Thanks. And the weather?' }];
  const t = await post('/tokenize', { messages: conversation, tools: tools2 });
  assert.equal(t.status, 200, JSON.stringify(t.body));
  const text = (await post('/detokenize', { tokens: t.body.tokens })).body.prompt;
  const { execFileSync } = await import('node:child_process');
  const { readFileSync, writeFileSync, mkdtempSync } = await import('node:fs');
  const { tmpdir } = await import('node:os');
  const config = JSON.parse(readFileSync(process.env.MLASERVE_TINY_MODEL_DIR + '/tokenizer_config.json', 'utf8'));
  const dir = mkdtempSync(tmpdir() + '/mlaserve-jinja2-');
  const msgs = [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'Name three colours.' }, ...conversation.slice(2)];
  writeFileSync(dir + '/in.json', JSON.stringify([{ template: config.chat_template, context: {
    messages: msgs, add_generation_prompt: true, bos_token: '<｜begin▁of▁sentence｜>', eos_token: '<｜end▁of▁sentence｜>', tools: tools2, documents: null } }]));
  execFileSync('/usr/bin/python3', [process.env.MLASERVE_SOURCE_DIR + '/tests/template/jinja2_oracle.py', dir + '/in.json', dir + '/out.json']);
  const [want] = JSON.parse(readFileSync(dir + '/out.json', 'utf8'));
  assert.ok(want.ok, JSON.stringify(want));
  assert.equal(text, want.output);
  assert.ok(text.includes('<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n' + forcedCall.function.arguments + '\n```<｜tool▁call▁end｜>'), text);
  assert.ok(text.includes('<｜tool▁output▁begin｜>12:00 UTC<｜tool▁output▁end｜>'), text);
  const r = await client.chat.completions.create({ model, messages: conversation, ...greedy, tools: tools2 });
  assert.equal(r.usage.prompt_tokens, t.body.count);
});

await check('404 unknown model', () =>
  expectStatus(404, () => client.chat.completions.create({ model: 'no-such-model', messages }), 'model'));
await check('400 bad parameters', async () => {
  await expectStatus(400, () => client.chat.completions.create({ model, messages, temperature: 5 }), 'temperature');
  await expectStatus(400, () => client.chat.completions.create({ model, messages, temperature: 'hot' }), 'temperature');
  await expectStatus(400, () => client.chat.completions.create({ model, messages, logprobs: true, top_logprobs: 21 }), 'top_logprobs');
  await expectStatus(400, () => client.chat.completions.create({ model, messages, n: 0 }), 'n');
  await expectStatus(400, () => client.chat.completions.create({ model, messages: [] }), 'messages');
  await expectStatus(400, () => client.chat.completions.create({ model, messages, response_format: { type: 'json_schema', json_schema: { name: 'x', schema: {} } } }), 'response_format');
  await expectStatus(400, () => client.chat.completions.create({ model, messages, chat_template_kwargs: { add_generation_prompt: false } }), 'chat_template_kwargs');
  await expectStatus(400, () => client.chat.completions.create({ model, messages, logit_bias: { 5: 10 } }), 'logit_bias');
  await expectStatus(400, () => client.completions.create({ model, prompt: 'x', echo: true }), 'echo');
});
await check('400 prompt too long', async () => {
  // max_model_len (the tiny model's cache: 256 blocks) is well below this.
  const len = (await client.models.list()).data[0].max_model_len;
  assert.ok(len > 0 && len < 100000, `max_model_len ${len}`);
  for (const create of [
    () => client.chat.completions.create({ model, messages, max_tokens: len }),
    () => client.completions.create({ model, prompt: 'Hello', max_tokens: len })]) {
    try {
      await create();
      assert.fail('expected HTTP 400');
    } catch (e) {
      assert.equal(e.status, 400, String(e));
      assert.equal(e.error.code, 'context_length_exceeded', JSON.stringify(e.error));
    }
  }
});
await check('401 without the API key', () =>
  expectStatus(401, () => new OpenAI({ baseURL: process.env.OPENAI_BASE_URL, apiKey: 'wrong', maxRetries: 0 }).models.list()));

await check('64 concurrent streams each end exactly once', async () => {
  const runs = await Promise.all(Array.from({ length: 64 }, (_, i) =>
    collectChat({ model, messages: [{ role: 'user', content: `Count to ${i}.` }], temperature: 0, max_tokens: 6, ignore_eos: true })));
  for (const s of runs) {
    assert.deepEqual(s.finishes, { 0: 'length' });
    assert.equal(s.usage.completion_tokens, 6);
  }
});

console.log(failures ? `${failures} check(s) failed` : 'all checks passed');
process.exit(failures ? 1 : 0);
