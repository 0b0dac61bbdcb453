// Values of the Jinja subset: Python's data model as chat templates see it (None, bool, int,
// float, str, list, dict with insertion order, plus Jinja's Undefined, namespace() objects and
// callables such as macros).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "nlohmann/json.hpp"

namespace mlaserve::jinja {

// A template failed while rendering; the message is shown to the user as is.
class RenderError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Value;

// The deepest nesting of lists, dicts and namespaces a value may have (JSON messages included):
// deeper values, which chat templates never need, would make printing, comparing and freeing
// them recurse without bound.
inline constexpr int kMaxValueDepth = 100;

using List = std::vector<Value>;
// Python dicts keep insertion order; chat template dicts have string keys.
using Dict = std::vector<std::pair<std::string, Value>>;
struct CallArgs;
using Callable = std::function<Value(CallArgs&)>;

class Value {
 public:
  enum class Kind {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kNamespace,
    kCallable
  };

  Value() = default;  // Undefined
  static Value Undefined(std::string name = "") {
    Value v;
    v.string_ = std::move(name);
    return v;
  }
  static Value None() { return Value(Kind::kNone); }
  static Value Bool(bool b) {
    Value v(Kind::kBool);
    v.int_ = b;
    return v;
  }
  static Value Int(int64_t i) {
    Value v(Kind::kInt);
    v.int_ = i;
    return v;
  }
  static Value Float(double f) {
    Value v(Kind::kFloat);
    v.float_ = f;
    return v;
  }
  static Value String(std::string s) {
    Value v(Kind::kString);
    v.string_ = std::move(s);
    return v;
  }
  static Value MakeList(List items) {
    Value v(Kind::kList);
    for (const Value& item : items) v.Contain(item);
    v.list_ = std::make_shared<List>(std::move(items));
    return v;
  }
  static Value MakeDict(Dict items) {
    Value v(Kind::kDict);
    for (const auto& kv : items) v.Contain(kv.second);
    v.dict_ = std::make_shared<Dict>(std::move(items));
    return v;
  }
  static Value MakeNamespace(Dict items) {
    Value v = MakeDict(std::move(items));
    v.kind_ = Kind::kNamespace;
    v.holds_namespace_ = true;
    return v;
  }
  static Value MakeCallable(Callable fn, std::string name) {
    Value v(Kind::kCallable);
    v.callable_ = std::make_shared<Callable>(std::move(fn));
    v.string_ = std::move(name);
    return v;
  }
  // Throws RenderError for a value nested more than kMaxValueDepth deep.
  static Value FromJson(const nlohmann::ordered_json& json, int depth = 0);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_number() const {
    return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool;
  }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_mapping() const { return kind_ == Kind::kDict || kind_ == Kind::kNamespace; }

  bool AsBool() const { return int_ != 0; }
  int64_t AsInt() const {
    if (kind_ != Kind::kFloat) return int_;
    // Python's int(float) of NaN or infinity raises; a larger float has no int64 (C++: UB).
    if (!(float_ > -9.2e18 && float_ < 9.2e18)) {
      throw RenderError("cannot convert float " + std::to_string(float_) + " to an integer");
    }
    return static_cast<int64_t>(float_);
  }
  double AsFloat() const { return kind_ == Kind::kFloat ? float_ : static_cast<double>(int_); }
  const std::string& AsString() const { return string_; }  // also an Undefined's name
  const List& AsList() const { return *list_; }
  const Dict& AsDict() const { return *dict_; }
  Dict& MutableDict() const { return *dict_; }  // namespaces are shared and mutable
  const Callable& AsCallable() const { return *callable_; }
  // Nesting depth (0 for a scalar, 1 for a list of scalars).
  int depth() const { return depth_; }
  // Whether this is, or holds, a namespace (whose attributes can change after it is made).
  bool holds_namespace() const { return holds_namespace_; }

  // Python truthiness.
  bool Truthy() const;
  // Dict lookup; nullptr when absent.
  const Value* Find(const std::string& key) const;
  // Python str() of the value as Jinja prints it ("None", "True", "[1, 'a']"; Undefined: "").
  std::string Str() const;
  // Python repr().
  std::string Repr() const;
  // Python ==.
  bool Equals(const Value& other) const;
  std::string TypeName() const;

 private:
  explicit Value(Kind kind) : kind_(kind) {}
  void Contain(const Value& item) {
    if (item.depth_ + 1 > depth_) depth_ = item.depth_ + 1;
    if (depth_ > kMaxValueDepth) {
      throw RenderError("value nested more than " + std::to_string(kMaxValueDepth) + " deep");
    }
    holds_namespace_ = holds_namespace_ || item.holds_namespace_;
  }
  Kind kind_ = Kind::kUndefined;
  int depth_ = 0;
  bool holds_namespace_ = false;
  int64_t int_ = 0;
  double float_ = 0;
  std::string string_;
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<Callable> callable_;
};

// Positional and keyword arguments of a call.
struct CallArgs {
  List positional;
  Dict keyword;
  // Argument `index` or keyword `name`; `fallback` when neither was given.
  Value Get(size_t index, const std::string& name, Value fallback = Value()) const;
};

// Python's repr() of a float (shortest round-trip, "1.0", "1e-07", "1e+16", "inf", "nan").
std::string PythonFloatRepr(double value);

// json.dumps(value, ensure_ascii=False, indent=indent, separators=..., sort_keys=...) as
// Hugging Face's tojson filter calls it. indent < 0: no indentation.
std::string PythonJsonDumps(const Value& value, int indent, const std::string& item_separator,
                            const std::string& key_separator, bool sort_keys);

}  // namespace mlaserve::jinja
