// The official OpenAI client (npm `openai`) driving `k3 serve` as a black box, for tests/test_serve.cpp.
// Usage: node tests/tools/serve_openai_client.mjs BASE_URL MODEL
// Prints one line per check ("ok" or "FAIL") and exits 1 if any failed. The JSON the server was asked
// for (a json_schema reply, a forced tool call's arguments) is validated with ajv against the schema
// sent. openai and ajv come from <repo>/.deps/npm (scripts/setup.sh installs them).
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, '../../.deps/npm/node_modules/'));
const OpenAI = require('openai');
const Ajv = require('ajv');

const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 0, timeout: 120000 });
const ajv = new Ajv();
let failures = 0;
function check(ok, what) {
  if (!ok) failures++;
  console.log(`${ok ? 'ok  ' : 'FAIL'} ${what}`);
}
async function status(request) {
  try {
    await request;
    return 200;
  } catch (e) {
    return e.status ?? -1;
  }
}
function parse(text) {
  try {
    return JSON.parse(text);
  } catch {
    return undefined;
  }
}

const messages = [{ role: 'user', content: 'Name three colours.' }];

// A plain reply, then the same streamed: the client's chunks put together equal it.
const plain = await client.chat.completions.create({ model, messages, temperature: 0, max_tokens: 12 });
check(plain.object === 'chat.completion' && plain.choices.length === 1, 'chat: one choice');
check(plain.usage.prompt_tokens > 0 && plain.usage.completion_tokens > 0, 'chat: usage');
const stream = await client.chat.completions.create({
  model, messages, temperature: 0, max_tokens: 12, stream: true, stream_options: { include_usage: true },
});
let content = '', reasoning = '', finish = null, usage = null;
for await (const chunk of stream) {
  if (chunk.usage) usage = chunk.usage;
  for (const c of chunk.choices) {
    content += c.delta.content ?? '';
    reasoning += c.delta.reasoning_content ?? '';
    if (c.finish_reason) finish = c.finish_reason;
  }
}
const message = plain.choices[0].message;
check(content === (message.content ?? ''), 'stream: the content equals the plain reply\'s');
check(reasoning === (message.reasoning_content ?? ''), 'stream: the reasoning equals the plain reply\'s');
check(finish === plain.choices[0].finish_reason, 'stream: the finish reason');
check(usage !== null && usage.completion_tokens === plain.usage.completion_tokens, 'stream: the usage chunk');

// response_format json_schema: the reply validates.
const schema = {
  type: 'object',
  properties: { ok: { type: 'boolean' }, level: { enum: ['low', 'high'] }, n: { type: 'integer' } },
  required: ['ok', 'level', 'n'],
  additionalProperties: false,
};
const validate = ajv.compile(schema);
for (const seed of [5, 6]) {
  const r = await client.chat.completions.create({
    model, messages, thinking: false, temperature: 1, seed, max_tokens: 300,
    response_format: { type: 'json_schema', json_schema: { name: 'answer', schema, strict: true } },
  });
  const doc = parse(r.choices[0].message.content);
  check(doc !== undefined && validate(doc), `json_schema (seed ${seed}): the reply validates against the schema`);
}

// tool_choice required: one call, its arguments valid for the tool, plain and streamed.
const weather = {
  type: 'object',
  properties: { city: { enum: ['Paris', 'Oslo'] }, days: { type: 'integer' } },
  required: ['city'],
  additionalProperties: false,
};
const validate_weather = ajv.compile(weather);
const tools = [{ type: 'function', function: { name: 'get_weather', parameters: weather } }];
const forced = await client.chat.completions.create({
  model, messages, thinking: false, temperature: 1, seed: 7, max_tokens: 300, tools, tool_choice: 'required',
});
const calls = forced.choices[0].message.tool_calls ?? [];
check(forced.choices[0].finish_reason === 'tool_calls' && calls.length === 1, 'tools: one call, finish_reason tool_calls');
check(calls.length === 1 && calls[0].function.name === 'get_weather' &&
      validate_weather(parse(calls[0].function.arguments) ?? null), 'tools: the arguments validate against the tool');
const forced_stream = await client.chat.completions.create({
  model, messages, thinking: false, temperature: 1, seed: 7, max_tokens: 300, tools, tool_choice: 'required',
  stream: true,
});
let streamed_args = '', streamed_name = '';
for await (const chunk of forced_stream)
  for (const c of chunk.choices)
    for (const call of c.delta.tool_calls ?? []) {
      streamed_name += call.function?.name ?? '';
      streamed_args += call.function?.arguments ?? '';
    }
check(calls.length === 1 && streamed_name === calls[0].function.name && streamed_args === calls[0].function.arguments,
      'tools: the streamed call equals the plain one');

// logprobs.
const lp = await client.chat.completions.create({
  model, messages, temperature: 0, max_tokens: 6, logprobs: true, top_logprobs: 2,
});
const entries = lp.choices[0].logprobs?.content ?? [];
check(entries.length === lp.usage.completion_tokens &&
      entries.every((e) => e.logprob <= 0 && e.top_logprobs.length === 2 &&
                           e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob),
      'logprobs: one entry per token, two alternatives, most probable first');

// Completions and models.
const completion = await client.completions.create({ model, prompt: 'the cat sat on the mat', max_tokens: 5, temperature: 0 });
check(typeof completion.choices[0].text === 'string' && completion.usage.completion_tokens > 0, 'completions');
const models = await client.models.list();
check(models.data.length === 1 && models.data[0].id === model, 'models: the one served');

// Errors come back as the client's APIError with the status.
check(await status(client.chat.completions.create({ model, messages, temperature: 5 })) === 400,
      'errors: temperature 5 is a 400');
check(await status(client.chat.completions.create({ model: 'gpt-9', messages })) === 404, 'errors: another model is a 404');
check(await status(client.chat.completions.create({ model, messages, tool_choice: 'required' })) === 400,
      'errors: tool_choice required without tools is a 400');
check(await status(client.chat.completions.create({
  model, messages, response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'string', pattern: 'a' } } },
})) === 400, 'errors: an unsupported schema keyword is a 400');

process.exit(failures ? 1 : 0);
