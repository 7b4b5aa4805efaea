#!/bin/sh
# Builds the Go client offline: stubs from protos/ with protoc, then `go build` in GOPATH mode
# against Debian's packaged modules (apt-get install golang-go golang-google-grpc-dev
# golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev protobuf-compiler
# protoc-gen-go-grpc; the 1.3 `golang-goprotobuf-dev` cannot decode current stubs).
# Usage: clients/go/build.sh OUT_BINARY
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-$here/tandem-go}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
gen="$work/src/tandem/gen/go"
mkdir -p "$gen" "$work/src/tandemclient" "$work/bin"
export GOPATH="$work:/usr/share/gocode" GO111MODULE=off GOFLAGS= GOCACHE="$work/cache"
# Debian's /usr/bin/protoc-gen-go is the 1.3 generator (no proto3 `optional`): build the
# current one from the packaged google.golang.org/protobuf sources.
go build -o "$work/bin/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go
PATH="$work/bin:$PATH" protoc -I "$root/protos" --go_out="$gen" --go_opt=paths=source_relative \
    --go-grpc_out="$gen" --go-grpc_opt=paths=source_relative "$root"/protos/tandem/v1/*.proto
cp "$here/main.go" "$work/src/tandemclient/"
cd "$work/src/tandemclient"
go build -o "$out" .
