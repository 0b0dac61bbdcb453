// The load generator's HTTP/SSE mode: streaming POST /v1/completions requests (token-id
// prompts, "stream": true with include_usage) against mlaserve-openai, kept `concurrency` in
// flight over kept-alive connections, all driven from one thread by epoll (so 1,024 open streams
// cost the client little). Times each request's events as the ZeroMQ mode times its chunks.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace mlaserve::bench {

struct HttpLoadOptions {
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;  // Bearer, when set
  std::string model;    // empty: the first of GET /v1/models
  int concurrency = 1;
};

struct HttpRequestSpec {
  std::vector<int32_t> prompt;
  int max_tokens = 0;
};

// What one request saw. `events`: SSE data events with text (the server sends none for a token
// whose text the detokenizer holds back); `tokens`: the usage chunk's completion_tokens.
struct HttpRequestResult {
  std::chrono::steady_clock::time_point sent, first, last;
  int events = 0;
  int tokens = 0;
  std::vector<double> gaps;  // seconds between consecutive events
  std::string error;         // empty when it ended with its usage and [DONE]
};

struct HttpLoadReport {
  std::vector<HttpRequestResult> results;  // in the order of `specs`
  int peak_open_streams = 0;  // streams past their first event and not finished, at most
  double wall_seconds = 0;
  std::string error;  // set when the run could not start (no server, no model)
};

// Runs `specs` with options.concurrency of them in flight (a finished stream's connection takes
// the next request).
HttpLoadReport RunHttpLoad(const HttpLoadOptions& options,
                           const std::vector<HttpRequestSpec>& specs);

}  // namespace mlaserve::bench
