# mlaserve wire messages (Cap'n Proto, unpacked, one message per ZeroMQ frame).
#
# Clients talk to the coordinator's ROUTER socket: each request frame is a ClientRequest, and the
# coordinator answers with one or more ServerReply frames carrying the request's `requestId`
# (chosen by the client, unique per client connection). A generate request gets zero or more
# `chunk` replies and then exactly one `final` (or one `error`).
# The coordinator talks to worker rank 0 over a second socket with StepPlan / StepResult.
@0xd4a5c1f0b7e3a921;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("mlaserve::wire");

struct SamplingParams {
  temperature @0 :Float32 = 0.0;        # 0: greedy
  topP @1 :Float32 = 1.0;
  topK @2 :Int32 = 0;                   # 0: off
  minP @3 :Float32 = 0.0;
  repetitionPenalty @4 :Float32 = 1.0;  # > 0; 1: off (prompt + output tokens)
  presencePenalty @5 :Float32 = 0.0;    # -2..2 (output tokens)
  frequencyPenalty @6 :Float32 = 0.0;   # -2..2 (output tokens)
  seed @7 :UInt64 = 0;
  hasSeed @8 :Bool = false;
  maxTokens @9 :UInt32 = 256;
  minTokens @10 :UInt32 = 0;
  stop @11 :List(Text);                 # stop strings, matched on the detokenized text
  stopTokenIds @12 :List(Int32);
  ignoreEos @13 :Bool = false;
  logprobs @14 :Bool = false;
  topLogprobs @15 :UInt32 = 0;          # 0..20 alternatives per token
  skipSpecialTokens @16 :Bool = true;
  priority @17 :Int32 = 0;              # higher is scheduled first
}

struct ToolCall {
  id @0 :Text;
  name @1 :Text;
  arguments @2 :Text;                   # JSON text
}

struct ChatMessage {
  role @0 :Text;                        # system | user | assistant | tool
  content @1 :Text;
  name @2 :Text;
  toolCallId @3 :Text;
  toolCalls @4 :List(ToolCall);
  reasoningContent @5 :Text;
}

struct GenerateRequest {
  input :union {
    text @0 :Text;                      # raw prompt text (tokenized with special tokens)
    tokenIds @1 :List(Int32);
    chat @2 :List(ChatMessage);         # rendered with the model's own chat template
  }
  tools @3 :Text;                       # JSON array of tool definitions, or empty
  addGenerationPrompt @4 :Bool = true;
  sampling @5 :SamplingParams;
  batchedReplies @6 :Bool = false;      # the client reads frames holding several ServerReply
                                        # messages back to back (each in flat-array framing):
                                        # this request's replies may then share a frame with
                                        # other such replies to the same client (one frame per
                                        # client per step instead of one per token)
}

struct ClientRequest {
  requestId @0 :UInt64;
  union {
    generate @1 :GenerateRequest;
    abort @2 :Void;                     # aborts the request with this requestId
    health @3 :Void;
    modelInfo @4 :Void;
  }
}

struct TokenLogprob {
  tokenId @0 :Int32;
  logprob @1 :Float32;
  top @2 :List(TopLogprob);
}

struct TopLogprob {
  tokenId @0 :Int32;
  logprob @1 :Float32;
}

enum FinishReason {
  stop @0;
  length @1;
  abort @2;
  error @3;
}

struct Usage {
  promptTokens @0 :UInt32;
  completionTokens @1 :UInt32;
  cachedTokens @2 :UInt32;
  queueSeconds @3 :Float64;
  ttftSeconds @4 :Float64;
  totalSeconds @5 :Float64;
}

enum ErrorCode {
  invalidRequest @0;     # malformed message, bad parameters
  promptTooLong @1;
  overloaded @2;
  notFound @3;
  internal @4;
  workerFailed @5;
  shuttingDown @6;
}

struct ServerReply {
  requestId @0 :UInt64;
  union {
    chunk :group {
      tokenIds @1 :List(Int32);
      text @2 :Text;                    # text delta (exactly the final text when concatenated)
      logprobs @3 :List(TokenLogprob);
    }
    final :group {
      finishReason @4 :FinishReason;
      usage @5 :Usage;
      text @6 :Text;                    # the whole completion text
      tokenIds @7 :List(Int32);         # the whole completion
      message @14 :Text;                # for finishReason error/abort: why
      errorCode @15 :ErrorCode;         # for finishReason error: the cause's code (workerFailed:
                                        # the worker job failed while the request was in flight);
                                        # meaningless for other finish reasons
    }
    error :group {
      code @8 :ErrorCode;
      message @9 :Text;
    }
    health :group {
      ok @10 :Bool;
      detail @11 :Text;
    }
    modelInfo :group {
      json @12 :Text;                   # model name, config summary, ranks, KV format, limits
    }
    accepted @13 :Void;                 # abort acknowledged
  }
}

# Coordinator -> worker rank 0 (broadcast to every rank over MPI).
struct StepSequence {
  seqId @0 :UInt64;
  tokens @1 :List(Int32);               # new tokens fed this step
  startPosition @2 :UInt32;             # tokens already in the cache
  blockTable @3 :List(Int32);
  promptLen @4 :UInt32;                 # for penalties: which tokens are output tokens
  sample @5 :Bool;                      # sample a token after the last new token
  sampling @6 :SamplingParams;         # sent with a sequence's first step only; workers keep it
  generated @7 :UInt32;                 # tokens generated so far (the sampling step index)
  eosIds @8 :List(Int32);               # masked while generated < minTokens (first step only)
  blockTableFrom @9 :UInt32;            # blockTable holds the table's entries from this index
                                        # on; the workers keep the entries before it from the
                                        # sequence's earlier steps (0: the whole table)
}

struct StepPlan {
  stepId @0 :UInt64;
  union {
    step @1 :List(StepSequence);
    shutdown @2 :Void;
    ping @3 :Void;
  }
  release @4 :List(UInt64);             # sequences that ended: workers drop their state
}

struct SampledToken {
  seqId @0 :UInt64;
  tokenId @1 :Int32;
  logprob @2 :TokenLogprob;
}

struct StepResult {
  stepId @0 :UInt64;
  union {
    sampled @1 :List(SampledToken);
    error @2 :Text;
    pong @3 :Void;
    ready @4 :Text;                     # sent once after loading: model info JSON
  }
  rankSeconds @5 :List(Float64);        # forward time of each rank
  sampleSeconds @6 :Float64;
}
