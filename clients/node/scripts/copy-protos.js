// npm pack / publish: copy the repository's protos into the package (prepack), so the
// tarball carries the contract it loads (client.js looks there first); --remove (postpack)
// takes the copy away again, so the repository never runs on a stale one.
const fs = require("fs");
const path = require("path");

const source = path.resolve(__dirname, "..", "..", "..", "protos");
const target = path.resolve(__dirname, "..", "protos");
fs.rmSync(target, { recursive: true, force: true });
if (!process.argv.includes("--remove")) {
  fs.cpSync(source, target, { recursive: true });
}
