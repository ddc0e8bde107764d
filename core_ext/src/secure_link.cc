#include "secure_link.h"

#include <map>

#include "auth.h"

namespace bps {

namespace {

constexpr size_t kNonce = 32;
constexpr size_t kTag = 16;                 // each of the two per-frame tags
constexpr uint32_t kIdentityLen = 128;
constexpr int kKeyIterations = 100000;      // PBKDF2 rounds for the cluster key

// What the connecting side offers for bodies (kAuthHello), bit by bit.
constexpr uint32_t kOfferPoly1305 = 1, kOfferNoBodyTags = 2;

// Everything both ends said that decides the session; every proof and key covers it.
struct Transcript {
  std::string nc, ns, identity;
  uint32_t offer = 0;
  BodyAuth choice = BodyAuth::kHmacSha256;

  std::string Mac(const std::string& key, const char* label) const {
    MetaWriter w;
    w.Str(label).Str(nc).Str(ns).Str(identity).U32(offer).U32(static_cast<uint32_t>(choice));
    return HmacSha256(key, w.bytes());
  }
};

std::shared_ptr<Link> Wrap(std::shared_ptr<Link> raw, const std::string& key, const Transcript& t, bool connector) {
  std::string c2a = t.Mac(key, "connector->acceptor");
  std::string a2c = t.Mac(key, "acceptor->connector");
  if (connector) return std::make_shared<SecureLink>(std::move(raw), c2a, a2c, t.choice);
  return std::make_shared<SecureLink>(std::move(raw), a2c, c2a, t.choice);
}

uint32_t Offer(bool body_tags) {
  return (Poly1305Available() ? kOfferPoly1305 : 0) | (body_tags ? 0 : kOfferNoBodyTags);
}

FrameHeader Header(MsgType t) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(t);
  return h;
}

// One handshake frame; anything else (or a plain kError, for the connecting side) ends it.
std::string Expect(Link& link, MsgType want) {
  FrameHeader h;
  std::string meta;
  if (!link.RecvFrame(&h, &meta, 0, kHandshakeMetaLen))
    throw Error(Error::kPeer, "connection to " + link.peer() + " closed during the handshake");
  if (h.type == static_cast<uint16_t>(MsgType::kError) && want != MsgType::kAuthHello) {
    std::string why;
    try {
      why = MetaReader(meta).Str();
    } catch (const FrameError&) {
      why = "(unreadable reason)";
    }
    throw Error(Error::kConfig, link.peer() + " refused this node: " + why);
  }
  if (h.type != static_cast<uint16_t>(want))
    throw FrameError("expected handshake frame " + std::to_string(static_cast<int>(want)) + ", got type " +
                     std::to_string(h.type));
  return meta;
}

}  // namespace

std::string ClusterKey(const std::string& secret) {
  if (secret.empty()) return "";
  static std::mutex mu;
  static std::map<std::string, std::string> cache;
  std::lock_guard<std::mutex> lk(mu);
  auto it = cache.find(secret);
  if (it != cache.end()) return it->second;
  return cache[secret] = Pbkdf2Sha256(secret, "bpstrain cluster key v2", kKeyIterations);
}

SecureLink::SecureLink(std::shared_ptr<Link> inner, std::string send_key, std::string recv_key, BodyAuth body_auth)
    : inner_(std::move(inner)), send_key_(std::move(send_key)), recv_key_(std::move(recv_key)), body_auth_(body_auth) {
  peer_ = inner_->peer();
  peer_host_ = inner_->peer_host();
}

SecureLink::~SecureLink() = default;

void SecureLink::Send(FrameHeader h, const std::string& meta, const void* body, uint64_t body_len) {
  std::lock_guard<std::mutex> lk(send_mu_);
  const uint64_t seq = send_seq_++;
  h.magic = kFrameMagic;
  h.meta_len = static_cast<uint32_t>(meta.size() + 2 * kTag);
  h.body_len = body_len;
  std::string sealed = meta;
  sealed += Hmac(send_key_).U64(seq).Update(&h, sizeof h).Update(meta).Final().substr(0, kTag);
  if (body_len) {
    BodyMac mac(body_auth_, send_key_, seq);
    mac.Update(body, body_len);
    sealed += mac.Final();
  } else {
    sealed += std::string(kTag, '\0');
  }
  inner_->Send(h, sealed, body, body_len);
}

bool SecureLink::RecvFrame(FrameHeader* h, std::string* meta, uint64_t max_body, uint32_t max_meta) {
  if (body_left_) throw FrameError("a frame's body was not read before the next frame");
  if (!inner_->RecvFrame(h, meta, max_body, max_meta + 2 * kTag)) return false;
  const uint64_t seq = recv_seq_++;
  if (meta->size() < 2 * kTag) throw FrameError("an unauthenticated frame on an authenticated connection");
  const size_t n = meta->size() - 2 * kTag;
  const std::string tag = Hmac(recv_key_).U64(seq).Update(h, sizeof *h).Update(meta->data(), n).Final();
  if (!ConstantTimeEqual(tag.substr(0, kTag), meta->substr(n, kTag)))
    throw FrameError("frame failed authentication (forged, replayed or corrupted)");
  body_tag_ = meta->substr(n + kTag);
  meta->resize(n);
  h->meta_len = static_cast<uint32_t>(n);
  body_left_ = h->body_len;
  if (body_left_) body_mac_ = std::make_unique<BodyMac>(body_auth_, recv_key_, seq);
  return true;
}

void SecureLink::RecvBody(void* dst, uint64_t n) {
  if (n == 0) return;
  if (n > body_left_) throw FrameError("read past the end of a frame's body");
  inner_->RecvBody(dst, n);
  body_mac_->Update(dst, n);
  if ((body_left_ -= n) == 0) CheckBody(body_mac_->Final());
}

void SecureLink::DiscardBody(uint64_t n) {
  if (n > body_left_) throw FrameError("read past the end of a frame's body");
  char buf[65536];
  while (n) {
    const uint64_t k = std::min<uint64_t>(n, sizeof buf);
    RecvBody(buf, k);
    n -= k;
  }
}

void SecureLink::CheckBody(const std::string& tag) {
  body_mac_.reset();
  if (!ConstantTimeEqual(tag.substr(0, kTag), body_tag_))
    throw FrameError("frame body failed authentication (forged or corrupted)");
}

std::shared_ptr<Link> SecureConnect(std::shared_ptr<Link> raw, const std::string& key, const std::string& identity,
                                    bool body_tags) {
  raw->SetDeadline(kHandshakeSeconds);
  Transcript t;
  t.nc = RandomBytes(kNonce);
  t.identity = identity;
  t.offer = Offer(body_tags);
  raw->Send(Header(MsgType::kAuthHello), MetaWriter().Str(t.nc).Str(identity).U32(!key.empty()).U32(t.offer).bytes());
  std::string proof;
  uint32_t acceptor_keyed = 0, choice = 0;
  try {
    const std::string meta = Expect(*raw, MsgType::kAuthChallenge);
    MetaReader r(meta);
    t.ns = r.Str();
    acceptor_keyed = r.U32();
    proof = r.Str();
    choice = r.U32();
  } catch (const FrameError& e) {
    throw Error(Error::kPeer, raw->peer() + " answered the handshake with a malformed frame: " + e.what());
  }
  t.choice = static_cast<BodyAuth>(choice);
  if (!key.empty()) {
    // The acceptor must prove the key before this node says anything more: a stranger
    // posing as the scheduler or a server learns nothing and gets no data.
    if (!acceptor_keyed || t.ns.size() != kNonce || !ConstantTimeEqual(proof, t.Mac(key, "acceptor")))
      throw Error(Error::kConfig, raw->peer() + " could not prove it holds this job's key: it is not this job's " +
                                      "scheduler/server, or it runs with another cluster secret");
    const bool offered = t.choice == BodyAuth::kHmacSha256 ||
                         (t.choice == BodyAuth::kPoly1305 && (t.offer & kOfferPoly1305)) ||
                         (t.choice == BodyAuth::kNone && (t.offer & kOfferNoBodyTags));
    if (!offered) throw Error(Error::kPeer, raw->peer() + " chose a body authenticator this node did not offer");
    raw->Send(Header(MsgType::kAuthProof), MetaWriter().Str(t.Mac(key, "connector")).bytes());
    try {
      const std::string ok = MetaReader(Expect(*raw, MsgType::kAuthOk)).Str();
      if (!ConstantTimeEqual(ok, t.Mac(key, "accepted")))
        throw FrameError("the acceptance does not carry the acceptor's proof");
    } catch (const FrameError& e) {
      throw Error(Error::kPeer, raw->peer() + " ended the handshake with a malformed frame: " + e.what());
    }
  } else if (acceptor_keyed) {
    throw Error(Error::kConfig, raw->peer() + " requires the cluster secret and this node has none " +
                                    "(set the same cluster.secret / BPSTRAIN_SECRET on every node)");
  }
  raw->SetDeadline(0);
  if (key.empty()) return raw;
  return Wrap(std::move(raw), key, t, /*connector=*/true);
}

std::shared_ptr<Link> ConnectSecure(Transport& transport, const std::string& endpoint, const std::string& key,
                                    const std::string& identity, double timeout_s, const std::atomic<bool>* cancel,
                                    bool body_tags) {
  const auto start = Clock::now();
  for (int attempt = 0;; ++attempt) {
    const double left = std::max(0.1, timeout_s - SecondsSince(start));
    std::shared_ptr<Link> raw = transport.Connect(endpoint, left, cancel);
    try {
      return SecureConnect(std::move(raw), key, identity, body_tags);
    } catch (const Error& e) {
      const bool transient = e.kind() == Error::kPeer || e.kind() == Error::kTimeout;
      if (!transient || (cancel && cancel->load()) || SecondsSince(start) > timeout_s) throw;
      LogDebug(std::string("handshake with ") + endpoint + " failed, retrying: " + e.what());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(attempt < 10 ? 50 : 250));
  }
}

std::shared_ptr<Link> SecureAccept(std::shared_ptr<Link> raw, const KeyLookup& key_for, std::string* identity,
                                   bool body_tags) {
  // A refusal is reported to the peer here and thrown to the caller, which logs it.
  auto refuse = [&](const std::string& why) -> std::shared_ptr<Link> {
    try {
      raw->Send(Header(MsgType::kError), MetaWriter().Str(why).bytes());
    } catch (const std::exception&) {
    }
    throw Error(Error::kConfig, why);
  };
  raw->SetDeadline(kHandshakeSeconds);
  Transcript t;
  std::string key;
  uint32_t connector_keyed = 0;
  {
    const std::string hello = Expect(*raw, MsgType::kAuthHello);  // MetaReader keeps a reference
    MetaReader r(hello);
    t.nc = r.Str();
    t.identity = r.Str();
    connector_keyed = r.U32();
    t.offer = r.U32();
  }
  *identity = t.identity;
  if (t.nc.size() != kNonce || identity->size() > kIdentityLen) throw FrameError("malformed handshake hello");
  if (!key_for(*identity, &key)) return refuse(key);
  if (key.empty() && connector_keyed)
    return refuse("this node runs without a cluster secret and the connecting node has one (set the same "
                  "cluster.secret / BPSTRAIN_SECRET on every node)");
  if (!key.empty() && !connector_keyed)
    return refuse("wrong or missing cluster secret (set the same cluster.secret / BPSTRAIN_SECRET on every node)");
  // Bodies: untagged only if both ends asked for it; else the fastest MAC both have.
  t.choice = (t.offer & kOfferNoBodyTags) && !body_tags ? BodyAuth::kNone
             : (t.offer & kOfferPoly1305) && Poly1305Available() ? BodyAuth::kPoly1305
                                                                 : BodyAuth::kHmacSha256;
  t.ns = RandomBytes(kNonce);
  MetaWriter challenge;
  challenge.Str(t.ns).U32(!key.empty()).Str(key.empty() ? "" : t.Mac(key, "acceptor"));
  challenge.U32(static_cast<uint32_t>(t.choice));
  raw->Send(Header(MsgType::kAuthChallenge), challenge.bytes());
  if (!key.empty()) {
    const std::string proof = MetaReader(Expect(*raw, MsgType::kAuthProof)).Str();
    if (!ConstantTimeEqual(proof, t.Mac(key, "connector")))
      return refuse("wrong or missing cluster secret (set the same cluster.secret / BPSTRAIN_SECRET on every node)");
    raw->Send(Header(MsgType::kAuthOk), MetaWriter().Str(t.Mac(key, "accepted")).bytes());
  }
  raw->SetDeadline(0);
  if (key.empty()) return raw;
  return Wrap(std::move(raw), key, t, /*connector=*/false);
}

std::atomic<int> HandshakeSlots::total_{0};

std::unique_ptr<HandshakeSlots::Slot> HandshakeSlots::TryTake() {
  if (pending_.fetch_add(1) >= kMaxPendingHandshakes) {
    pending_.fetch_sub(1);
    ++refused_;
    return nullptr;
  }
  if (total_.fetch_add(1) >= kMaxPendingTotal) {
    total_.fetch_sub(1);
    pending_.fetch_sub(1);
    ++refused_;
    return nullptr;
  }
  return std::make_unique<Slot>(this);
}

void HandshakeSlots::NoteFailure(const std::string& from, const std::string& why) {
  const int n = ++failed_;
  if (n <= 10 || n % 1000 == 0)
    LogWarn("refused a connection from " + from + ": " + why +
            (n >= 10 ? " (" + std::to_string(n) + " refused so far; logging one in a thousand)" : ""));
}

HandshakeSlots::Slot::~Slot() {
  owner_->pending_.fetch_sub(1);
  HandshakeSlots::total_.fetch_sub(1);
}

}  // namespace bps
