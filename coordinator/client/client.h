// C++ client of the mlaserve coordinator: a ZeroMQ DEALER socket speaking the Cap'n Proto
// messages of schema/mlaserve.capnp. Synchronous calls (Generate with a streaming callback,
// Health, Info, Abort) and an asynchronous pair (Submit, Next) for many requests in flight.
// With ClientSecurity's key files the connection is CURVE-authenticated and encrypted
// (coordinator/auth/curve_keys.h has the file format); a handshake the server refuses, or one
// that cannot succeed (wrong server key, one side without CURVE), makes the waiting call return
// an error that says which, instead of waiting out its timeout.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace capnp {
class MessageBuilder;
}  // namespace capnp
namespace zmq {
class context_t;
class socket_t;
}  // namespace zmq

namespace mlaserve {

struct ClientSampling {
  float temperature = 0.0f;
  float top_p = 1.0f;
  int top_k = 0;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  std::optional<uint64_t> seed;
  uint32_t max_tokens = 256;
  uint32_t min_tokens = 0;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  bool logprobs = false;
  uint32_t top_logprobs = 0;
  bool skip_special_tokens = true;
  int32_t priority = 0;
};

struct GenerateInput {
  // Exactly one of: text, token_ids, chat (a JSON array of {role, content, ...} messages).
  std::optional<std::string> text;
  std::optional<std::vector<int32_t>> token_ids;
  std::optional<nlohmann::json> chat;
  std::string tools_json;  // JSON array of tool definitions, or empty
  bool add_generation_prompt = true;
  ClientSampling sampling;
};

struct TokenLogprobInfo {
  int32_t token_id = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};

// One reply frame, decoded.
struct Reply {
  enum class Kind { kChunk, kFinal, kError, kHealth, kModelInfo, kAccepted };
  Kind kind = Kind::kError;
  uint64_t request_id = 0;
  std::vector<int32_t> token_ids;  // chunk: new tokens; final: the whole completion
  std::string text;                // chunk: delta; final: whole text; health: detail; info: json
  std::vector<TokenLogprobInfo> logprobs;
  std::string finish_reason;  // final: stop | length | abort | error
  std::string error_code;     // error, and a final with finish_reason error: invalidRequest | ...
  std::string message;        // error / final error or abort: why
  bool ok = false;            // health
  uint32_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
  double queue_seconds = 0, ttft_seconds = 0, total_seconds = 0;
};

// CURVE key files of a client (mlaserve-cli keygen writes them): both or neither.
struct ClientSecurity {
  std::string server_key_file;  // the coordinator's public key (its .pub file)
  std::string client_key_file;  // this client's key pair (.key, mode 0600), allowed by the server
};

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& endpoint,
                                                         const ClientSecurity& security = {});
  ~Client();

  // Sends a generate request; returns its id. Replies come from Next().
  absl::StatusOr<uint64_t> Submit(const GenerateInput& input);
  absl::Status Abort(uint64_t request_id);
  // The next reply of any request, or DeadlineExceeded after `timeout`.
  absl::StatusOr<Reply> Next(std::chrono::milliseconds timeout);

  // Streams chunks to `on_chunk` and returns the final (or the error) reply.
  absl::StatusOr<Reply> Generate(const GenerateInput& input,
                                 const std::function<void(const Reply&)>& on_chunk,
                                 std::chrono::milliseconds timeout = std::chrono::minutes(10));
  absl::StatusOr<Reply> Health(std::chrono::milliseconds timeout = std::chrono::seconds(5));
  absl::StatusOr<Reply> Info(std::chrono::milliseconds timeout = std::chrono::seconds(5));

  // Sends raw bytes as one frame (tests of malformed input).
  absl::Status SendRaw(const std::string& bytes);

 private:
  Client() = default;
  absl::StatusOr<Reply> Call(uint64_t id, std::chrono::milliseconds timeout);
  absl::Status SendMessage(capnp::MessageBuilder& msg);
  // Reads the socket monitor's events; an error when handshakes fail. A refusal or a protocol
  // error ends ZeroMQ's reconnecting for good: that error is kept in handshake_error_ and
  // returned by every later call.
  absl::Status ReadHandshakeEvents();
  absl::Status handshake_error_;
  std::unique_ptr<zmq::context_t> ctx_;
  std::unique_ptr<zmq::socket_t> sock_;
  std::unique_ptr<zmq::socket_t> monitor_;  // ZMQ_EVENT_HANDSHAKE_* of sock_
  std::string endpoint_;
  bool curve_ = false;
  bool handshake_succeeded_ = false;  // at least once
  int silent_failures_ = 0;           // handshakes in a row the server closed without a reason
  uint64_t next_id_ = 1;
  std::deque<Reply> pending_;  // replies of a multi-message frame not yet returned
};

}  // namespace mlaserve
