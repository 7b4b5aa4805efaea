// A Go client for Tandem built from the protos alone: streams a Generate from an engine (or
// a gateway) and prints the text, then the finish reason and token count.
//
//	go run . -engine 127.0.0.1:50051 -prompt "Hello" -max-tokens 16
//
// clients/go/build.sh generates the stubs with protoc and builds it offline against Debian's
// packaged gRPC and protobuf modules (docs/clients.md).
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"google.golang.org/grpc"

	tandemv1 "tandem/gen/go/tandem/v1"
)

func main() {
	engine := flag.String("engine", "127.0.0.1:50051", "engine or gateway address")
	prompt := flag.String("prompt", "Hello from Go", "prompt text")
	maxTokens := flag.Int("max-tokens", 16, "tokens to generate")
	flag.Parse()

	// Plaintext, as the servers listen on loopback by default (Debian's grpc-go 1.33 has
	// WithInsecure; newer ones spell it credentials/insecure).
	conn, err := grpc.Dial(*engine, grpc.WithInsecure())
	if err != nil {
		fmt.Fprintln(os.Stderr, "dial:", err)
		os.Exit(4)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tokens := int32(*maxTokens)
	stream, err := tandemv1.NewEngineClient(conn).Generate(ctx, &tandemv1.GenerateRequest{
		Text:      *prompt,
		MaxTokens: &tokens,
		Sampling:  &tandemv1.SamplingParams{IgnoreEos: true},
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "generate:", err)
		os.Exit(1)
	}
	count := 0
	for {
		message, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "stream:", err)
			os.Exit(1)
		}
		count += len(message.TokenIds)
		fmt.Print(message.Text)
		if message.FinishReason != tandemv1.FinishReason_FINISH_REASON_UNSPECIFIED {
			fmt.Printf("\n%s %d\n", message.FinishReason, count)
		}
	}
}
