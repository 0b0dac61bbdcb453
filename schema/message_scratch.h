// Reusable memory for building Cap'n Proto messages in a loop (one streamed reply per token per
// request, one step plan per step) without heap traffic per message.
//
// The first segment is handed to MallocMessageBuilder, which requires it zeroed and re-zeroes
// what it used when it is destroyed (capnp/message.h); a message larger than the scratch spills
// to the heap as usual. Flatten() writes the standard stream framing (segment count - 1, segment
// sizes in words, padding, segments: what capnp::messageToFlatArray returns) into a buffer kept
// across calls.
//
//   MessageScratch scratch(64);
//   {
//     capnp::MallocMessageBuilder msg(scratch.FirstSegment());
//     ... build ...
//     Send(scratch.Flatten(msg));   // bytes valid until the next Flatten()
//   }  // the builder is gone before the next one takes the first segment
#pragma once

#include <capnp/message.h>
#include <kj/array.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mlaserve {

class MessageScratch {
 public:
  explicit MessageScratch(size_t first_segment_words);

  // The zeroed first segment for one live MallocMessageBuilder at a time. Grows (zeroed) to at
  // least `min_words` when asked; never while a builder holds it.
  kj::ArrayPtr<capnp::word> FirstSegment(size_t min_words = 0);

  // `msg` in flat-array form, identical to capnp::messageToFlatArray's bytes.
  kj::ArrayPtr<const kj::byte> Flatten(capnp::MessageBuilder& msg);

 private:
  kj::Array<capnp::word> first_;
  std::vector<uint64_t> out_;  // word-aligned output
};

}  // namespace mlaserve
