// A small Node.js client for Tandem: the protos (packed beside it, or ../../protos) are the whole contract, loaded at
// run time with @grpc/proto-loader (no generated code).
"use strict";

const fs = require("node:fs");
const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

// Installed from its tarball the protos sit beside this file; in the repository, two up.
const PACKED_PROTOS = path.resolve(__dirname, "protos");
const PROTO_ROOT = fs.existsSync(PACKED_PROTOS)
  ? PACKED_PROTOS
  : path.resolve(__dirname, "..", "..", "protos");

function loadServices() {
  const definition = protoLoader.loadSync(
    ["tandem/v1/engine.proto", "tandem/v1/store.proto"],
    { includeDirs: [PROTO_ROOT], keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true },
  );
  return grpc.loadPackageDefinition(definition).tandem.v1;
}

const tandem = loadServices();


/** The bearer token: from tokenFile (keeps it out of `ps`), else token, else TANDEM_TOKEN_FILE
 * or TANDEM_TOKEN; "" when none. */
function bearerToken({ token = "", tokenFile = "" } = {}) {
  const file = tokenFile || process.env.TANDEM_TOKEN_FILE || "";
  if (file) return fs.readFileSync(file, "utf8").trim();
  return token || process.env.TANDEM_TOKEN || "";
}

/** Adds `authorization: Bearer <token>` to every call (grpc-js refuses call credentials on a
 * plaintext channel, so an interceptor carries it). */
function tokenInterceptor(token) {
  return (options, nextCall) => new grpc.InterceptingCall(nextCall(options), {
    start(metadata, listener, next) {
      metadata.set("authorization", `Bearer ${token}`);
      next(metadata, listener);
    },
  });
}

/**
 * Clients for an engine and a store address: plaintext loopback by default; TLS with tlsCa (PEM
 * path; system roots when only tlsCert/tlsKey are given), a client certificate with tlsCert and
 * tlsKey (mTLS), a bearer token with token / tokenFile (or TANDEM_TOKEN[_FILE]).
 */
function connect({ engine, store, credentials, tlsCa, tlsCert, tlsKey, token, tokenFile } = {}) {
  if (!credentials) {
    const read = (p) => (p ? fs.readFileSync(p) : null);
    credentials = tlsCa || tlsCert
      ? grpc.credentials.createSsl(read(tlsCa), read(tlsKey), read(tlsCert))
      : grpc.credentials.createInsecure();
  }
  const bearer = bearerToken({ token, tokenFile });
  const options = bearer ? { interceptors: [tokenInterceptor(bearer)] } : {};
  return {
    engine: engine ? new tandem.Engine(engine, credentials, options) : null,
    store: store ? new tandem.Store(store, credentials, options) : null,
    admin: store ? new tandem.StoreAdmin(store, credentials, options) : null,
  };
}

/**
 * Streams a generation. onChunk(message) is called per streamed message (token_ids, text,
 * reasoning_text, tool_calls); resolves with { tokenIds, text, reasoningText, toolCalls,
 * finishReason, usage } once the stream ends (toolCalls: the calls' pieces merged), rejects with
 * the gRPC error.
 */
function generate(engine, request, onChunk = () => {}) {
  return new Promise((resolve, reject) => {
    const tokenIds = [];
    const pieces = [];
    let text = "";
    let reasoningText = "";
    let last = null;
    const call = engine.Generate(request);
    call.on("data", (message) => {
      tokenIds.push(...message.token_ids);
      text += message.text;
      reasoningText += message.reasoning_text || "";
      pieces.push(...(message.tool_calls || []));
      last = message;
      onChunk(message);
    });
    call.on("error", reject);
    call.on("end", () => resolve({
      tokenIds, text, reasoningText, toolCalls: mergeToolCalls(pieces),
      finishReason: last ? last.finish_reason : "", usage: last ? last.usage : null,
    }));
  });
}

/**
 * Whole tool calls ({ id, name, arguments }, arguments as JSON text) from the pieces a
 * generation streams (GenerateResponse.tool_calls: a call's first piece has its id and name,
 * later ones add to its arguments), in index order.
 */
function mergeToolCalls(pieces) {
  const calls = new Map();
  for (const piece of pieces) {
    const call = calls.get(piece.index) || { id: "", name: "", arguments: "" };
    call.id = call.id || piece.id;
    call.name = call.name || piece.name;
    call.arguments += piece.arguments;
    calls.set(piece.index, call);
  }
  return [...calls.keys()].sort((a, b) => a - b).map((index) => calls.get(index));
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

module.exports = { connect, generate, listCheckpoints, mergeToolCalls, unary, grpc };
