// A small MCP server over stdio, written with the official SDK (npm @modelcontextprotocol/sdk, with zod), for
// tests/test_env_mcp.cpp: the MCP environment (src/train/env_mcp.h) against a real server, working and misbehaving.
// Usage: node tests/mcp/calc_server.mjs. The SDK and zod come from <repo>/.deps/npm (scripts/setup.sh installs them).
//
// Tools (a handler of a tool without an inputSchema gets only the request's `extra`):
//   add {a, b}     the sum as text; structuredContent {reward, state}: reward 0.5 for the episode's first add (the
//                  episode's state, sent as params._meta["k3cpp/state"], counts them), 0 after
//   fail           an isError result (the model should see its message as ordinary content)
//   pid            this process's id, so the test can see the server relaunched and the old one gone
//   ask_client     pings the client (must answer {}), sends it a log notification, asks it roots/list (must answer
//                  "method not found"), and reports the two outcomes
//   crash          exits with status 3 before answering
//   hang           never answers
//   garbage        writes a line that is not JSON, then answers normally
//   wrong_id       writes a response with an id that was never sent, then answers normally
//   no_result      writes a response to this request with neither result nor error, then answers normally
//   grow           registers one more tool, double {x} (2x as text), the first time; the SDK then sends the client
//                  notifications/tools/list_changed before this call's response. A relaunched server is back to
//                  the tools above
//   reward {answer, response, state}  1 when the response text contains the answer, else 0; 0.25 more when the
//                  episode's state counts at least one add (hidden from the policy by the environment)
// tools/list is served in pages of 3 tools, so a client must follow nextCursor to see them all.
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, '../../.deps/npm/node_modules/'));
const { McpServer } = require('@modelcontextprotocol/sdk/server/mcp.js');
const { StdioServerTransport } = require('@modelcontextprotocol/sdk/server/stdio.js');
const { ListRootsResultSchema, ListToolsRequestSchema } = require('@modelcontextprotocol/sdk/types.js');
const { z } = require('zod');

const server = new McpServer({ name: 'k3cpp-calc', version: '1.0.0' }, { capabilities: { logging: {} } });
const text = (t) => ({ content: [{ type: 'text', text: String(t) }] });
const stateOf = (extra) => extra._meta?.['k3cpp/state'] ?? {};
const raw = (message) => process.stdout.write(JSON.stringify(message) + '\n');

server.registerTool(
  'add',
  { description: 'Adds two numbers.', inputSchema: { a: z.number(), b: z.number() } },
  async ({ a, b }, extra) => {
    const adds = stateOf(extra).adds ?? 0;
    return { ...text(a + b), structuredContent: { reward: adds === 0 ? 0.5 : 0, state: { adds: adds + 1 } } };
  },
);
server.registerTool('fail', { description: 'Always fails.' }, async () => ({
  ...text('fail: this tool always fails'),
  isError: true,
}));
server.registerTool('pid', { description: 'The server process id.' }, async () => text(process.pid));
server.registerTool('ask_client', { description: 'Talks back to the client.' }, async (extra) => {
  let ping, roots;
  try {
    await server.server.ping();
    ping = 'ok';
  } catch (e) {
    ping = `failed: ${e.message}`;
  }
  await extra.sendNotification({ method: 'notifications/message', params: { level: 'info', data: 'hello' } });
  try {
    await server.server.request({ method: 'roots/list' }, ListRootsResultSchema);
    roots = 'answered';
  } catch (e) {
    roots = `refused: ${e.message}`;
  }
  return text(`ping ${ping}\nroots/list ${roots}`);
});
server.registerTool('crash', { description: 'Exits.' }, async () => process.exit(3));
server.registerTool('hang', { description: 'Never answers.' }, () => new Promise(() => {}));
server.registerTool('garbage', { description: 'Writes a non-JSON line.' }, async () => {
  process.stdout.write('this is not JSON\n');
  return text('after the garbage');
});
server.registerTool('wrong_id', { description: 'Answers an id never sent.' }, async () => {
  raw({ jsonrpc: '2.0', id: 987654321, result: text('for nobody') });
  return text('after the wrong id');
});
server.registerTool('no_result', { description: 'Answers with neither result nor error.' }, async (extra) => {
  raw({ jsonrpc: '2.0', id: extra.requestId });
  return text('after the empty response');
});
let doubled = false;
server.registerTool('grow', { description: 'Adds the tool double.' }, async () => {
  if (!doubled) {
    doubled = true;
    server.registerTool(
      'double',
      { description: 'Doubles a number.', inputSchema: { x: z.number() } },
      async ({ x }) => text(2 * x),
    );
  }
  return text('grown');
});
server.registerTool(
  'reward',
  {
    description: 'The outcome reward.',
    inputSchema: { answer: z.any(), response: z.string(), state: z.any() },
  },
  async ({ answer, response, state }) =>
    text((response.includes(String(answer)) ? 1 : 0) + ((state?.adds ?? 0) > 0 ? 0.25 : 0)),
);

// Pages of 3 over the SDK's own listing. The SDK keeps no public hook for paging, so this wraps its registered
// handler (Protocol._requestHandlers; the SDK version is pinned by scripts/setup.sh).
const listAll = server.server._requestHandlers.get('tools/list');
server.server.setRequestHandler(ListToolsRequestSchema, async (request, extra) => {
  const all = (await listAll({ method: 'tools/list', params: {} }, extra)).tools;
  const start = Number(request.params?.cursor ?? 0);
  const page = { tools: all.slice(start, start + 3) };
  if (start + 3 < all.length) page.nextCursor = String(start + 3);
  return page;
});

await server.connect(new StdioServerTransport());
