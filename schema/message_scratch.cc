#include "schema/message_scratch.h"

#include <algorithm>
#include <cstring>

namespace mlaserve {

MessageScratch::MessageScratch(size_t first_segment_words)
    : first_(kj::heapArray<capnp::word>(std::max<size_t>(first_segment_words, 1))) {
  std::memset(first_.begin(), 0, first_.size() * sizeof(capnp::word));
}

kj::ArrayPtr<capnp::word> MessageScratch::FirstSegment(size_t min_words) {
  if (min_words > first_.size()) {
    first_ = kj::heapArray<capnp::word>(min_words + min_words / 2);
    std::memset(first_.begin(), 0, first_.size() * sizeof(capnp::word));
  }
  return first_.asPtr();
}

kj::ArrayPtr<const kj::byte> MessageScratch::Flatten(capnp::MessageBuilder& msg) {
  // Stream framing (Cap'n Proto encoding spec, "Serialization over a stream"): uint32 segment
  // count - 1, uint32 size in words of each segment, zero padding to a word, the segments.
  // Written by hand: capnp::writeMessage through kj::ArrayOutputStream cost ~430 instructions a
  // message (callgrind), more than building a streamed reply.
  const auto segments = msg.getSegmentsForOutput();
  const size_t table_words = segments.size() / 2 + 1;
  size_t words = table_words;
  for (const auto& seg : segments) words += seg.size();
  out_.resize(words);
  auto* table = reinterpret_cast<uint32_t*>(out_.data());
  table[0] = static_cast<uint32_t>(segments.size() - 1);
  for (size_t i = 0; i < segments.size(); ++i)
    table[i + 1] = static_cast<uint32_t>(segments[i].size());
  if (segments.size() % 2 == 0) table[segments.size() + 1] = 0;  // padding
  auto* dst = reinterpret_cast<kj::byte*>(out_.data() + table_words);
  for (const auto& seg : segments) {
    const size_t bytes = seg.size() * sizeof(capnp::word);
    std::memcpy(dst, seg.begin(), bytes);
    dst += bytes;
  }
  return kj::arrayPtr(reinterpret_cast<const kj::byte*>(out_.data()), words * sizeof(uint64_t));
}

}  // namespace mlaserve
