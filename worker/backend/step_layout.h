// A forward step's metadata, built once on the host (DESIGN.md "One model, two backends").
//
// The caller describes the step as a StepBatch (sequences in any order). BuildStepLayout checks
// it against the model (ids in the vocabulary, slots and block tables inside the pool) and puts
// the sequences in the order the attention kernels want: decode-shaped sequences first (a cached
// prefix and at most kMaxDecodeTokens new tokens; grouped by their token count, because the MLA
// decode kernel takes one s_q per call), then prefill sequences (empty prefix, or more new
// tokens). Each group's rows are then contiguous in every activation. Token-wise ops do not care
// about row order and attention is per sequence, so the order changes no result; logits rows are
// mapped back so that the caller sees them in its own order.
//
// The backend uploads the packed arrays once per step (Ops::BeginStep) into buffers that every
// layer's ops read.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace mlaserve {

// A sequence's part of a step: rows [token_begin, token_begin + num_tokens) of the step's
// tokens are its new tokens, at positions context_len .. context_len + num_tokens - 1.
struct SequenceSlice {
  int token_begin = 0;
  int num_tokens = 0;
  int context_len = 0;  // tokens already in the cache before this step
  std::vector<int32_t> block_table;
};

// One forward step over a batch of sequences, as the caller builds it.
struct StepBatch {
  std::vector<int32_t> tokens;     // [T]
  std::vector<int32_t> positions;  // [T]
  std::vector<int64_t> slots;      // [T]: cache slot (block * 64 + offset) of each new token
  std::vector<SequenceSlice> seqs;
  std::vector<int32_t> logits_rows;  // rows of T whose logits are wanted
};

// The MLA decode kernel takes 1..4 new tokens per sequence (mla_decode.h).
inline constexpr int kMaxDecodeTokens = 4;

struct StepLayout {
  int num_tokens = 0;
  int num_seqs = 0;
  // Rows in canonical order (row r of every activation is token tokens[r]).
  std::vector<int32_t> tokens, positions;  // [T]
  std::vector<int64_t> slots;              // [T]
  std::vector<int32_t> logits_rows;        // [R] canonical rows, in the caller's order
  // Sequences in canonical order.
  std::vector<SequenceSlice> seqs;    // token_begin re-based to canonical rows
  int max_blocks = 0;                 // width of block_tables (at least 1)
  std::vector<int32_t> block_tables;  // [S, max_blocks], unused entries 0
  std::vector<int32_t> seq_lens;      // [S] context_len + num_tokens
  std::vector<int32_t> context_lens;  // [S]
  // Under DCP (StepLayoutOptions::dcp_size > 1): [S] this rank's cached keys each one-token
  // sequence attends to (may be 0); empty otherwise.
  std::vector<int32_t> attend_lens;

  // Decode groups: sequences [seq_begin, seq_begin + num_seqs) each with s_q new tokens, rows
  // [row_begin, row_begin + num_seqs * s_q).
  struct DecodeGroup {
    int s_q = 0, seq_begin = 0, num_seqs = 0, row_begin = 0;
  };
  std::vector<DecodeGroup> decode;
  // The prefill group: sequences [seq_begin, num_seqs), rows [row_begin, num_tokens); each
  // attends to its cached prefix (read back from the cache) plus its new tokens.
  struct PrefillGroup {
    int seq_begin = 0, num_seqs = 0, row_begin = 0, num_rows = 0;
    int total_kv = 0;               // sum of context_len + num_tokens
    int max_q_len = 0;              // largest num_tokens
    std::vector<int32_t> q_begin;   // [num_seqs + 1] cumulative new tokens, from 0
    std::vector<int32_t> kv_begin;  // [num_seqs + 1] cumulative keys (prefix + new), from 0
  } prefill;
};

// force_absorbed sends every sequence, fresh or not, whatever its token count, to the decode
// groups (the absorbed, cache-reading attention; the CPU backend takes any count, tests use it).
//
// per_token_attention (the deterministic mode, issue 23) splits every sequence of n new tokens
// into n one-token sequences (the token at position p attends to cache positions 0..p through
// its sequence's block table), all in one decode group of s_q = 1. A token's attention is then
// the same computation whether it is decoded, prefilled or recomputed after preemption, and
// whatever else shares the step: the cache write of the whole step precedes attention in every
// layer, so the prefix a one-token sequence reads is in the cache. Rows stay in the caller's
// order (one sequence per row), and logits_rows are the caller's.
struct StepLayoutOptions {
  int vocab_size = 0;
  int64_t num_slots = 0;  // KV blocks * 64
  int num_blocks = 0;
  bool force_absorbed = false;
  bool per_token_attention = false;
  // Decode context parallelism (ModelOptions::dcp): dcp_size ranks split the cache by whole
  // blocks, global block g living on rank g % dcp_size as its local block g / dcp_size (the
  // caller's block ids and slots are global: num_blocks and num_slots count all ranks' pools).
  // This rank's layout: every token is a one-token sequence (as per_token_attention) whose block
  // table lists only this rank's blocks up to the token's position (local ids) and whose
  // attend_lens entry counts this rank's keys at positions <= the token's (0 when it has none);
  // slots are local, -1 for rows another rank stores.
  int dcp_rank = 0;
  int dcp_size = 1;
};

absl::StatusOr<StepLayout> BuildStepLayout(const StepBatch& batch,
                                           const StepLayoutOptions& options);

// A step every sequence of which decodes one token (the shape CUDA graphs replay).
bool IsSingleTokenDecode(const StepLayout& layout);

// Pads a single-token decode step to `batch` sequences and its block tables to `width` entries,
// so that every step of one (batch, width) bucket has the same shapes and the same buffer
// offsets. Padding sequences have one token (id 0, position 0) whose cache slot is -1 (the
// cache write skips it), a table of block 0 (read, never written) and a logits row each; the
// logits rows the caller asked for stay first, in its order.
void PadDecodeLayout(StepLayout* layout, int batch, int width);

}  // namespace mlaserve
