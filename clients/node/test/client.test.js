// Runs against real services: tests/test_node_client.py starts them and sets the addresses.
"use strict";

const test = require("node:test");
const assert = require("node:assert/strict");
const { connect, generate, listCheckpoints, mergeToolCalls, unary, grpc } = require("../client");

const engineAddress = process.env.TANDEM_ENGINE;
const storeAddress = process.env.TANDEM_STORE;
assert.ok(engineAddress && storeAddress, "TANDEM_ENGINE and TANDEM_STORE must be set");
const { engine, store, admin } = connect({ engine: engineAddress, store: storeAddress });

test("streams a generation with a finish reason and usage", async () => {
  const chunks = [];
  const result = await generate(engine, { text: "Hello from Node", max_tokens: 12, sampling: { ignore_eos: true } },
    (m) => chunks.push(m));
  assert.equal(result.tokenIds.length, 12);
  assert.equal(result.finishReason, "FINISH_REASON_LENGTH");
  assert.equal(result.usage.generated_tokens, 12);
  assert.ok(chunks.length >= 2, "streamed in several messages");
  const info = await unary(engine, "ModelInfo", {});
  assert.match(info.model_id, /^tandem-tiny@sha256:/);
});

test("tool call pieces merge into whole calls, in index order", () => {
  const pieces = [
    { index: 1, id: "call_b", name: "get_time", arguments: "" },
    { index: 0, id: "call_a", name: "get_weather", arguments: "" },
    { index: 0, id: "", name: "", arguments: '{"city": ' },
    { index: 1, id: "", name: "", arguments: '{"zone": "UTC"}' },
    { index: 0, id: "", name: "", arguments: '"Paris"}' },
  ];
  assert.deepEqual(mergeToolCalls(pieces), [
    { id: "call_a", name: "get_weather", arguments: '{"city": "Paris"}' },
    { id: "call_b", name: "get_time", arguments: '{"zone": "UTC"}' },
  ]);
});

test("seeded sampling is reproducible across calls", async () => {
  const request = { token_ids: [5, 6, 7, 8], max_tokens: 10, sampling: { temperature: 1.0, seed: 42, ignore_eos: true } };
  const a = await generate(engine, request);
  const b = await generate(engine, request);
  assert.deepEqual(a.tokenIds, b.tokenIds);
});

test("lists checkpoints written by the engine", async () => {
  const words = Array.from({ length: 120 }, (_, i) => `node${i}`).join(" ");
  await generate(engine, { text: words, max_tokens: 2, namespace: "node" });
  await unary(engine, "Flush", {});
  const records = await listCheckpoints(admin, { namespace: "node" });
  assert.equal(records.length, 1);
  assert.equal(records[0].kind, "RECORD_KIND_PREFIX");
  assert.ok(records[0].payload_bytes > 0);
  const stats = await unary(admin, "Stats", {});
  assert.ok(stats.records >= 1);
});

test("bad input comes back as INVALID_ARGUMENT, unknown keys as NOT_FOUND", async () => {
  await assert.rejects(generate(engine, { text: "hi", max_tokens: -1 }),
    (error) => error.code === grpc.status.INVALID_ARGUMENT);
  await assert.rejects(unary(admin, "Inspect", { key: Buffer.from("no-such-key") }),
    (error) => error.code === grpc.status.NOT_FOUND);
});

test.after(() => { engine.close(); store.close(); admin.close(); });
