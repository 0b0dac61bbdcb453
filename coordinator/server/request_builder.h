// Turns a client's GenerateRequest into prompt token ids and checked parameters: raw text is
// tokenized (with the model's special-token rules), chat messages are rendered with the model's
// own chat template and then tokenized, token ids are range-checked. Every problem is an
// InvalidArgument status with a message the client can act on.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "capnp/message.h"
#include "coordinator/chat_template/chat_template.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "mlaserve.capnp.h"

namespace mlaserve {

// What the coordinator knows of the model and its text side.
struct ModelText {
  int vocab_size = 0;
  int max_model_len = 0;
  std::vector<int32_t> eos_ids;
  std::unique_ptr<Tokenizer> tokenizer;           // null: token-id requests only
  std::optional<ChatTemplate> chat_template;      // from tokenizer_config.json
  std::string bos_token, eos_token;               // as the template sees them

  // Loads tokenizer.json / tiktoken.model and tokenizer_config.json from `folder` where present;
  // a broken tokenizer or template is an error here, at start-up.
  static absl::StatusOr<ModelText> Load(const std::string& folder, int vocab_size,
                                        int max_model_len, std::vector<int32_t> eos_ids);
};

// Sampling parameters as the workers apply them (schema SamplingParams).
struct SamplingSettings {
  float temperature = 0.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  uint32_t top_logprobs = 0;
};

struct PreparedRequest {
  std::vector<int32_t> prompt;
  SamplingSettings sampling;
  uint32_t max_tokens = 0;
  uint32_t min_tokens = 0;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  bool skip_special_tokens = true;
  bool logprobs = false;
  int32_t priority = 0;
  uint64_t seed = 0;
  bool has_seed = false;
};

// How a client frame is read (Coordinator::HandleClientMessage, fuzz/client_request_fuzzer.cc):
// client messages are small, so a reader that refuses huge or deeply nested ones.
capnp::ReaderOptions ClientReaderOptions();

absl::StatusOr<PreparedRequest> PrepareRequest(wire::GenerateRequest::Reader request,
                                               const ModelText& model);

}  // namespace mlaserve
