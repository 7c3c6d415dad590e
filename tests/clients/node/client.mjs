// Drives a toolkv server with the openai npm package, unchanged, and prints what it got as JSON.
// Usage: node client.mjs BASE_URL SPEC_JSON (see tests/clients/test_node_openai.py for the spec);
// spec.suite picks the scripted-model suite or the forced and structured one for the real model.
import OpenAI from "openai";

const [baseURL, specText] = process.argv.slice(2);
const spec = JSON.parse(specText);
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0 });
const request = (messages, extra = {}) => ({
  model: spec.model, messages, tools: spec.tools, temperature: 0, max_tokens: spec.maxTokens ?? 200, ...extra,
});

async function streamedChunks(messages) {
  const chunks = [];
  for await (const chunk of await client.chat.completions.create(request(messages, { stream: true }))) {
    chunks.push(chunk);
  }
  return chunks;
}

async function streamHelper(messages) {
  const argumentsDone = [];
  const stream = client.chat.completions.stream(request(messages));
  stream.on("tool_calls.function.arguments.done", (e) => argumentsDone.push({ index: e.index, name: e.name, arguments: e.arguments }));
  return { final: await stream.finalChatCompletion(), argumentsDone };
}

async function roundTrip(messages) {
  const first = await client.chat.completions.create(request(messages));
  const message = first.choices[0].message;
  const results = message.tool_calls.map((call) => ({ role: "tool", tool_call_id: call.id, content: spec.toolResult }));
  const second = await client.chat.completions.create(request([...messages, message, ...results]));
  return { first, second };
}

async function runTools(messages) {
  // The SDK's own agent loop: call the model, run the function, send the result, until it answers.
  const ran = [];
  const tools = spec.tools.map((tool) => ({
    type: "function",
    function: {
      name: tool.function.name, description: tool.function.description, parameters: tool.function.parameters,
      function: (args) => { ran.push({ name: tool.function.name, args }); return spec.toolResult; },
      parse: JSON.parse,
    },
  }));
  const runner = client.chat.completions.runTools({ model: spec.model, messages, tools, temperature: 0, max_tokens: 200 });
  const content = await runner.finalContent();
  return { ran, content, steps: runner.allChatCompletions().map((c) => c.usage) };
}

async function scripted() {
  return {
    create: await client.chat.completions.create(request(spec.twoCalls)),
    chunks: await streamedChunks(spec.twoCalls),
    helper: await streamHelper(spec.oneCall),
    forced: await client.chat.completions.create(request(spec.forcedContinuation, {
      tool_choice: { type: "function", function: { name: "get_order_details" } }, parallel_tool_calls: false,
    })),
    roundTrip: await roundTrip(spec.oneCall),
    runTools: await runTools(spec.oneCall),
  };
}

async function forcedRunTools() {
  // With a named tool_choice the SDK's loop runs that one function and stops.
  const ran = [];
  const tools = spec.tools.map((tool) => ({
    type: "function",
    function: {
      name: tool.function.name, description: tool.function.description, parameters: tool.function.parameters,
      function: (args) => { ran.push({ name: tool.function.name, args }); return spec.toolResult; },
      parse: JSON.parse,
    },
  }));
  const runner = client.chat.completions.runTools(request(spec.statusMessages, {
    tools, tool_choice: { type: "function", function: { name: spec.namedTool } },
  }));
  await runner.done();
  return { ran, completions: runner.allChatCompletions() };
}

async function forcedStreamHelper() {
  const chunks = [], contentDeltas = [], argumentDeltas = [], argumentsDone = [];
  const stream = client.chat.completions.stream(request(spec.cancelMessages, { tool_choice: "required" }));
  stream.on("chunk", (chunk) => chunks.push(chunk));
  stream.on("content.delta", (e) => contentDeltas.push(e.delta));
  stream.on("tool_calls.function.arguments.delta", (e) => argumentDeltas.push(e.arguments_delta));
  stream.on("tool_calls.function.arguments.done", (e) => argumentsDone.push({ name: e.name, arguments: e.arguments }));
  const final = await stream.finalChatCompletion();
  return { chunks, contentDeltas, argumentDeltas, argumentsDone, final };
}

async function structuredParse() {
  const completion = await client.chat.completions.parse({
    model: spec.model, messages: spec.structuredMessages, response_format: spec.responseFormat, temperature: 0,
    max_tokens: spec.maxTokens,
  });
  return { parsed: completion.choices[0].message.parsed, finish_reason: completion.choices[0].finish_reason };
}

async function attempt(scenario) {
  // One scenario's failure (an SDK error such as LengthFinishReasonError) is reported, not fatal.
  try {
    return await scenario();
  } catch (error) {
    return { error: `${error.constructor.name}: ${error.message}` };
  }
}

async function forced() {
  return {
    runTools: await attempt(forcedRunTools),
    helper: await attempt(forcedStreamHelper),
    parse: await attempt(structuredParse),
  };
}

const suites = { scripted, forced };
console.log(JSON.stringify(await suites[spec.suite]()));
