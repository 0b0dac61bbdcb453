#include "coordinator/http/tool_calls.h"

#include <algorithm>

namespace mlaserve::openai {
namespace {

std::string Trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) {
    return "";
  }
  const size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

std::optional<int32_t> Single(const Tokenizer& t, const char* text) { return t.TokenToId(text); }

// Kimi's call id `functions.NAME:IDX` (its template writes tool_call.id there): NAME.
std::string KimiName(const std::string& id) {
  std::string s = id;
  if (s.rfind("functions.", 0) == 0) {
    s = s.substr(10);
  }
  const size_t colon = s.rfind(':');
  return colon == std::string::npos ? s : s.substr(0, colon);
}

}  // namespace

std::optional<ToolCallMarkers> ToolCallMarkers::FromTokenizer(const Tokenizer& t) {
  struct Candidate {
    ToolCallFormat format;
    const char* text[5];  // section_begin, section_end, call_begin, separator, call_end
  };
  static const Candidate kCandidates[] = {
      {ToolCallFormat::kKimiK2,
       {"<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>", "<|tool_call_end|>"}},
      {ToolCallFormat::kDeepSeekV3,
       {"<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>"}},
  };
  for (const Candidate& c : kCandidates) {
    std::optional<int32_t> ids[5];
    bool all = true;
    for (int i = 0; i < 5; ++i) {
      all = all && (ids[i] = Single(t, c.text[i])).has_value();
    }
    if (!all) {
      continue;
    }
    ToolCallMarkers m;
    m.format = c.format;
    m.section_begin = *ids[0];
    m.section_end = *ids[1];
    m.call_begin = *ids[2];
    m.separator = *ids[3];
    m.call_end = *ids[4];
    return m;
  }
  return std::nullopt;
}

ToolCallParser::ToolCallParser(const Tokenizer& tokenizer, std::optional<ToolCallMarkers> markers,
                               bool skip_special_tokens, std::vector<int32_t> verbatim_ids,
                               std::string id_prefix)
    : tokenizer_(tokenizer),
      markers_(markers),
      detok_(tokenizer, skip_special_tokens),
      verbatim_ids_(std::move(verbatim_ids)),
      id_prefix_(std::move(id_prefix)) {}

void ToolCallParser::StartCall(std::string id, std::string name, ParsedDelta& out) {
  ToolCallDelta d;
  d.index = num_calls_++;
  d.id = std::move(id);
  d.name = std::move(name);
  out.tool_calls.push_back(std::move(d));
}

void ToolCallParser::Route(const std::string& text, ParsedDelta& out) {
  if (text.empty()) {
    return;
  }
  switch (state_) {
    case State::kText:
      out.content += text;
      break;
    case State::kSection:  // between calls: the templates put nothing there but newlines
      break;
    case State::kHeader:
    case State::kFencedBody:
      buffer_ += text;
      break;
    case State::kArguments:
      if (!out.tool_calls.empty() && out.tool_calls.back().index == num_calls_ - 1) {
        out.tool_calls.back().arguments += text;
      } else {
        ToolCallDelta d;
        d.index = num_calls_ - 1;
        d.arguments = text;
        out.tool_calls.push_back(std::move(d));
      }
      break;
  }
}

// DeepSeek-V3's body after <｜tool▁sep｜>: NAME "\n```json\n" ARGS "\n```".
void ToolCallParser::EndFencedCall(ParsedDelta& out) {
  std::string body = buffer_;
  buffer_.clear();
  const size_t nl = body.find('\n');
  std::string name = Trim(body.substr(0, nl));
  std::string args = nl == std::string::npos ? "" : body.substr(nl + 1);
  args = Trim(args);
  if (args.rfind("```json", 0) == 0) {
    args = args.substr(7);
  }
  if (args.size() >= 3 && args.compare(args.size() - 3, 3, "```") == 0) {
    args.resize(args.size() - 3);
  }
  StartCall(id_prefix_ + std::to_string(num_calls_), std::move(name), out);
  out.tool_calls.back().arguments = Trim(args);
}

ParsedDelta ToolCallParser::Add(int32_t id) {
  ParsedDelta out;
  const bool verbatim =
      std::find(verbatim_ids_.begin(), verbatim_ids_.end(), id) != verbatim_ids_.end();
  const bool marker = markers_ && (id == markers_->section_begin || id == markers_->section_end ||
                                   id == markers_->call_begin || id == markers_->separator ||
                                   id == markers_->call_end);
  if (!marker && !verbatim) {
    Route(detok_.Add(id), out);
    return out;
  }
  // Text held back before a marker belongs to the part the marker ends.
  Route(detok_.Finish(), out);
  if (verbatim) {
    const int32_t one[] = {id};
    Route(tokenizer_.Decode(one, /*skip_special_tokens=*/false), out);
    return out;
  }
  const ToolCallMarkers& m = *markers_;
  if (id == m.section_begin) {
    if (state_ == State::kText) {
      state_ = State::kSection;
    }
  } else if (id == m.call_begin) {
    // DeepSeek-V3's template also opens a section with call_begin right after calls_begin;
    // a call_begin in plain text starts the section implicitly.
    if (state_ == State::kFencedBody) {
      EndFencedCall(out);
    }
    state_ = State::kHeader;
    buffer_.clear();
  } else if (id == m.separator && state_ == State::kHeader) {
    const std::string header = Trim(buffer_);
    buffer_.clear();
    if (m.format == ToolCallFormat::kKimiK2) {
      StartCall(header, KimiName(header), out);
      state_ = State::kArguments;
    } else if (header == "function") {
      state_ = State::kFencedBody;  // DeepSeek-V3: TYPE before the separator, NAME after
    } else {
      StartCall(id_prefix_ + std::to_string(num_calls_), header, out);
      state_ = State::kArguments;
    }
  } else if (id == m.call_end) {
    if (state_ == State::kFencedBody) {
      EndFencedCall(out);
    }
    state_ = State::kSection;
    buffer_.clear();
  } else if (id == m.section_end) {
    if (state_ == State::kFencedBody) {
      EndFencedCall(out);
    }
    state_ = State::kText;
    buffer_.clear();
  }
  return out;
}

ParsedDelta ToolCallParser::Finish() {
  ParsedDelta out;
  Route(detok_.Finish(), out);
  if (state_ == State::kFencedBody) {
    EndFencedCall(out);
  }
  state_ = State::kText;
  return out;
}

}  // namespace mlaserve::openai
