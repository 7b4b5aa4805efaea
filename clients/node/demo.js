// Streams a generation and lists the store's checkpoints:
//   TANDEM_ENGINE=127.0.0.1:50051 TANDEM_STORE=127.0.0.1:50061 node demo.js "Hello"
"use strict";

const { connect, generate, listCheckpoints } = require("./client");

async function main() {
  const { engine, admin } = connect({
    engine: process.env.TANDEM_ENGINE || "127.0.0.1:50051",
    store: process.env.TANDEM_STORE || "127.0.0.1:50061",
  });
  const prompt = process.argv[2] || "Hello from Node.js";
  const result = await generate(engine, { text: prompt, max_tokens: 24 }, (m) => process.stdout.write(m.text));
  process.stdout.write(`\n[${result.finishReason}: ${result.usage.generated_tokens} tokens]\n`);
  const records = await listCheckpoints(admin);
  for (const r of records) {
    console.log(`${r.key.toString("hex").slice(0, 16)}  ${r.namespace}  ${r.kind}  ${r.token_count} tokens  ${r.payload_bytes} bytes`);
  }
  console.log(`${records.length} checkpoints`);
  engine.close();
  admin.close();
}

main().catch((error) => {
  console.error(`tandem demo: ${error.message}`);
  process.exit(1);
});
