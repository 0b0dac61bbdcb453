#include "coordinator/chat_template/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace mlaserve::jinja {
namespace {

// Code points Python's str.isprintable() rejects among those chat data plausibly holds:
// controls, non-space separators and format characters (a subset of Cc, Cf, Zs, Zl, Zp).
bool PythonNonPrintable(char32_t cp) {
  return cp < 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200F) || (cp >= 0x2028 && cp <= 0x202F) ||
         (cp >= 0x205F && cp <= 0x206F) || cp == 0x3000 || cp == 0xFEFF ||
         (cp >= 0xFFF9 && cp <= 0xFFFB);
}

char32_t NextCodePoint(const std::string& s, size_t* pos) {
  const auto b = [&](size_t i) { return static_cast<char32_t>(static_cast<uint8_t>(s[i])); };
  const char32_t b0 = b(*pos);
  size_t len = b0 < 0x80 ? 1 : b0 < 0xE0 ? 2 : b0 < 0xF0 ? 3 : 4;
  if (*pos + len > s.size()) len = 1;
  char32_t cp = len == 1 ? b0 : len == 2 ? b0 & 0x1F : len == 3 ? b0 & 0x0F : b0 & 0x07;
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (b(*pos + k) & 0x3F);
  *pos += len;
  return cp;
}

std::string PythonStringRepr(const std::string& s) {
  const char quote =
      (s.find('\'') != std::string::npos && s.find('"') == std::string::npos) ? '"' : '\'';
  std::string out(1, quote);
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t start = pos;
    const char32_t cp = NextCodePoint(s, &pos);
    char buf[16];
    if (cp == static_cast<char32_t>(quote) || cp == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(cp));
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (PythonNonPrintable(cp)) {
      std::snprintf(buf, sizeof(buf), cp < 0x100 ? "\\x%02x" : "\\u%04x",
                    static_cast<unsigned>(cp));
      out += buf;
    } else {
      out.append(s, start, pos - start);
    }
  }
  out.push_back(quote);
  return out;
}

void JsonString(const std::string& s, std::string* out) {
  out->push_back('"');
  for (const char c : s) {
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      case '\b':
        *out += "\\b";
        break;
      case '\f':
        *out += "\\f";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
          *out += buf;
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

void JsonDump(const Value& v, int indent, int level, const std::string& item_sep,
              const std::string& key_sep, bool sort_keys, std::string* out) {
  const auto newline = [&](int lvl) {
    if (indent < 0) return;
    out->push_back('\n');
    out->append(static_cast<size_t>(indent * lvl), ' ');
  };
  switch (v.kind()) {
    case Value::Kind::kNone:
      *out += "null";
      return;
    case Value::Kind::kBool:
      *out += v.AsBool() ? "true" : "false";
      return;
    case Value::Kind::kInt:
      *out += std::to_string(v.AsInt());
      return;
    case Value::Kind::kFloat: {
      const double f = v.AsFloat();
      if (std::isnan(f)) {
        *out += "NaN";
      } else if (std::isinf(f)) {
        *out += f > 0 ? "Infinity" : "-Infinity";
      } else {
        *out += PythonFloatRepr(f);
      }
      return;
    }
    case Value::Kind::kString:
      JsonString(v.AsString(), out);
      return;
    case Value::Kind::kList: {
      if (v.AsList().empty()) {
        *out += "[]";
        return;
      }
      out->push_back('[');
      bool first = true;
      for (const Value& item : v.AsList()) {
        if (!first) *out += item_sep;
        first = false;
        newline(level + 1);
        JsonDump(item, indent, level + 1, item_sep, key_sep, sort_keys, out);
      }
      newline(level);
      out->push_back(']');
      return;
    }
    case Value::Kind::kDict: {
      if (v.AsDict().empty()) {
        *out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& item : v.AsDict()) items.push_back(&item);
      if (sort_keys) {
        std::stable_sort(items.begin(), items.end(),
                         [](const auto* a, const auto* b) { return a->first < b->first; });
      }
      out->push_back('{');
      bool first = true;
      for (const auto* item : items) {
        if (!first) *out += item_sep;
        first = false;
        newline(level + 1);
        JsonString(item->first, out);
        *out += key_sep;
        JsonDump(item->second, indent, level + 1, item_sep, key_sep, sort_keys, out);
      }
      newline(level);
      out->push_back('}');
      return;
    }
    default:
      throw RenderError("tojson: Object of type " + v.TypeName() + " is not JSON serializable");
  }
}

}  // namespace

Value Value::FromJson(const nlohmann::ordered_json& json, int depth) {
  if (depth > kMaxValueDepth) {
    throw RenderError("JSON value nested more than " + std::to_string(kMaxValueDepth) + " deep");
  }
  switch (json.type()) {
    case nlohmann::ordered_json::value_t::null:
      return None();
    case nlohmann::ordered_json::value_t::boolean:
      return Bool(json.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Int(json.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned:
      return Int(static_cast<int64_t>(json.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float:
      return Float(json.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return String(json.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List items;
      for (const auto& item : json) items.push_back(FromJson(item, depth + 1));
      return MakeList(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict items;
      for (const auto& [key, item] : json.items()) items.emplace_back(key, FromJson(item, depth + 1));
      return MakeDict(std::move(items));
    }
    default:
      return Value();
  }
}

bool Value::Truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
    case Kind::kInt:
      return int_ != 0;
    case Kind::kFloat:
      return float_ != 0;
    case Kind::kString:
      return !string_.empty();
    case Kind::kList:
      return !list_->empty();
    case Kind::kDict:
      return !dict_->empty();
    default:
      return true;
  }
}

const Value* Value::Find(const std::string& key) const {
  if (!is_mapping()) return nullptr;
  for (const auto& [k, v] : *dict_) {
    if (k == key) return &v;
  }
  return nullptr;
}

std::string Value::Str() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "";
    case Kind::kString:
      return string_;
    default:
      return Repr();
  }
}

std::string Value::Repr() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return int_ ? "True" : "False";
    case Kind::kInt:
      return std::to_string(int_);
    case Kind::kFloat:
      return PythonFloatRepr(float_);
    case Kind::kString:
      return PythonStringRepr(string_);
    case Kind::kList: {
      std::string out = "[";
      for (size_t i = 0; i < list_->size(); ++i) out += (i ? ", " : "") + (*list_)[i].Repr();
      return out + "]";
    }
    case Kind::kDict: {
      std::string out = "{";
      for (size_t i = 0; i < dict_->size(); ++i) {
        out += (i ? ", " : "") + PythonStringRepr((*dict_)[i].first) + ": " +
               (*dict_)[i].second.Repr();
      }
      return out + "}";
    }
    case Kind::kNamespace:
      return "<Namespace>";
    case Kind::kCallable:
      return "<function " + string_ + ">";
  }
  return "";
}

bool Value::Equals(const Value& o) const {
  if (is_number() && o.is_number()) {
    if (kind_ == Kind::kFloat || o.kind_ == Kind::kFloat) return AsFloat() == o.AsFloat();
    return int_ == o.int_;
  }
  if (kind_ != o.kind_) return false;
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      return string_ == o.string_;
    case Kind::kList: {
      if (list_->size() != o.list_->size()) return false;
      for (size_t i = 0; i < list_->size(); ++i) {
        if (!(*list_)[i].Equals((*o.list_)[i])) return false;
      }
      return true;
    }
    case Kind::kDict: {
      if (dict_->size() != o.dict_->size()) return false;
      for (const auto& [k, v] : *dict_) {
        const Value* other = o.Find(k);
        if (other == nullptr || !v.Equals(*other)) return false;
      }
      return true;
    }
    default:
      return dict_ == o.dict_ && callable_ == o.callable_;
  }
}

std::string Value::TypeName() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return "list";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kCallable:
      return "function";
  }
  return "?";
}

Value CallArgs::Get(size_t index, const std::string& name, Value fallback) const {
  if (index < positional.size()) return positional[index];
  for (const auto& [k, v] : keyword) {
    if (k == name) return v;
  }
  return fallback;
}

std::string PythonFloatRepr(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), value, std::chars_format::scientific);
  std::string sci(buf, end);  // shortest round-trip digits: "-d.ddde+XX"
  const bool negative = sci[0] == '-';
  if (negative) sci.erase(0, 1);
  const size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exponent = std::atoi(sci.c_str() + e + 1);
  std::string out = negative ? "-" : "";
  if (exponent >= -4 && exponent < 16) {
    if (exponent < 0) {
      out += "0." + std::string(-exponent - 1, '0') + digits;
    } else if (static_cast<int>(digits.size()) <= exponent + 1) {
      out += digits + std::string(exponent + 1 - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, exponent + 1) + "." + digits.substr(exponent + 1);
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  char exp_buf[8];
  std::snprintf(exp_buf, sizeof(exp_buf), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
  return out + exp_buf;
}

std::string PythonJsonDumps(const Value& value, int indent, const std::string& item_separator,
                            const std::string& key_separator, bool sort_keys) {
  std::string out;
  JsonDump(value, indent, 0, item_separator, key_separator, sort_keys, &out);
  return out;
}

}  // namespace mlaserve::jinja
