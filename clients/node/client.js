// A small Node.js client for Tandem: the protos in ../../protos are the whole contract, loaded at
// run time with @grpc/proto-loader (no generated code).
"use strict";

const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "protos");

function loadServices() {
  const definition = protoLoader.loadSync(
    ["tandem/v1/engine.proto", "tandem/v1/store.proto"],
    { includeDirs: [PROTO_ROOT], keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true },
  );
  return grpc.loadPackageDefinition(definition).tandem.v1;
}

const tandem = loadServices();

/** Clients for an engine and a store address (insecure loopback by default). */
function connect({ engine, store, credentials = grpc.credentials.createInsecure() } = {}) {
  return {
    engine: engine ? new tandem.Engine(engine, credentials) : null,
    store: store ? new tandem.Store(store, credentials) : null,
    admin: store ? new tandem.StoreAdmin(store, credentials) : null,
  };
}

/**
 * Streams a generation. onChunk(message) is called per streamed message (token_ids, text); resolves
 * with { tokenIds, text, finishReason, usage } once the stream ends, rejects with the gRPC error.
 */
function generate(engine, request, onChunk = () => {}) {
  return new Promise((resolve, reject) => {
    const tokenIds = [];
    let text = "";
    let last = null;
    const call = engine.Generate(request);
    call.on("data", (message) => {
      tokenIds.push(...message.token_ids);
      text += message.text;
      last = message;
      onChunk(message);
    });
    call.on("error", reject);
    call.on("end", () => resolve({
      tokenIds, text, finishReason: last ? last.finish_reason : "", usage: last ? last.usage : null,
    }));
  });
}

function unary(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, (error, response) => (error ? reject(error) : resolve(response)));
  });
}

/** Every checkpoint matching a filter ({ namespace, model_id, kind }), following the pages. */
async function listCheckpoints(admin, filter = {}) {
  const records = [];
  let pageToken = "";
  do {
    const page = await unary(admin, "List", { filter, page_size: 100, page_token: pageToken });
    records.push(...page.records);
    pageToken = page.next_page_token;
  } while (pageToken);
  return records;
}

module.exports = { connect, generate, listCheckpoints, unary, grpc };
