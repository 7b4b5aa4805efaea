// Against an engine and a store run with --auth-file: tests/test_security.py starts them and
// passes the addresses and a token file (TANDEM_TOKEN_FILE) of a principal with every role.
"use strict";

const test = require("node:test");
const assert = require("node:assert/strict");
const { connect, generate, unary, grpc } = require("../client");

const addresses = { engine: process.env.TANDEM_ENGINE, store: process.env.TANDEM_STORE };
assert.ok(process.env.TANDEM_TOKEN_FILE, "TANDEM_TOKEN_FILE must be set");

test("a token file authenticates every call", async () => {
  const { engine, store } = connect(addresses);
  const result = await generate(engine, { token_ids: [5, 6, 7], max_tokens: 3 });
  assert.equal(result.tokenIds.length, 3);
  const flushed = await unary(store, "Flush", {});
  assert.equal(flushed.durable, true);
});

test("without a token the servers answer UNAUTHENTICATED", async () => {
  const saved = process.env.TANDEM_TOKEN_FILE;
  delete process.env.TANDEM_TOKEN_FILE;
  try {
    const { engine, store } = connect(addresses);
    await assert.rejects(unary(engine, "ModelInfo", {}), (e) => e.code === grpc.status.UNAUTHENTICATED);
    await assert.rejects(unary(store, "Flush", {}), (e) => e.code === grpc.status.UNAUTHENTICATED);
  } finally {
    process.env.TANDEM_TOKEN_FILE = saved;
  }
});
