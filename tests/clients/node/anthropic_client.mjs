// Drives a toolkv server with the @anthropic-ai/sdk npm package, unchanged: the SDK's own agent loop,
// client.beta.messages.toolRunner(...), with its defaults (a server-side message thread), whole and
// streamed. Prints JSON: per run, the tools it ran, the final message and what each request sent.
// Usage: node anthropic_client.mjs BASE_URL SPEC_JSON (see tests/clients/test_node_anthropic.py).
import Anthropic from "@anthropic-ai/sdk";
import { betaTool } from "@anthropic-ai/sdk/helpers/beta/json-schema";

const [baseURL, specText] = process.argv.slice(2);
const spec = JSON.parse(specText);

async function run(stream) {
  const sent = [];
  const recording = async (url, init) => {
    const response = await fetch(url, init);
    if (String(url).endsWith("/v1/messages")) {
      const body = JSON.parse(init.body);
      const beta = new Headers(init.headers).get("anthropic-beta") ?? "";
      sent.push({ status: response.status, beta, thread: body.thread ?? null, keys: Object.keys(body),
                  blocks: body.messages.flatMap((m) => (typeof m.content === "string" ? ["string"] : m.content.map((b) => b.type))) });
    }
    return response;
  };
  const client = new Anthropic({ baseURL, apiKey: "unused", maxRetries: 0, fetch: recording });
  const ran = [];
  const tool = betaTool({
    name: "get_order_details", description: "Get the status and details of an order.",
    inputSchema: { type: "object", properties: { order_id: { type: "string" } }, required: ["order_id"],
                   additionalProperties: false },
    run: (input) => { ran.push(input.order_id); return spec.toolResult; },
  });
  const runner = client.beta.messages.toolRunner({
    model: spec.model, max_tokens: 200, system: spec.system, messages: spec.messages, tools: [tool], stream,
  });
  const final = await runner.runUntilDone();
  return { ran, final, sent };
}

console.log(JSON.stringify({ whole: await run(false), streamed: await run(true) }));
