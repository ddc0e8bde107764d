// pybind11 bindings of the engine: the only file that includes pybind11.
//
// Blocking calls are exposed as short waits (`wait(handle, seconds)`) with the GIL
// released; bpstrain/engine.py loops over them, so Ctrl-C and Python-level timeouts
// always work. C++ errors become bpstrain.errors exceptions in exactly one place
// (TranslateError below).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>
#include <set>

#include "../src/affinity.h"
#include "../src/auth.h"
#include "../src/body_mac.h"
#include "../src/codec.h"
#include "../src/common.h"
#include "../src/reduce.h"
#include "../src/scheduler.h"
#include "../src/secure_link.h"
#include "../src/send_policy.h"
#include "../src/server.h"
#include "../src/server_handler.h"
#include "../src/transport.h"
#include "../src/tuning.h"
#include "../src/ucx_context.h"
#include "../src/worker.h"

namespace py = pybind11;
using namespace bps;

namespace {

void TranslateError(const Error& e) {
  static const char* names[] = {"BpsError", "MismatchError", "PeerError",
                                "BpsTimeoutError", "ConfigError", "ShutdownError"};
  py::object errors = py::module_::import("bpstrain.errors");
  py::object cls = errors.attr(names[static_cast<int>(e.kind())]);
  PyErr_SetString(cls.ptr(), e.what());
}

struct BufferView {
  void* ptr;
  size_t nbytes;
};

BufferView View(const py::buffer& b, bool writable, const char* what) {
  py::buffer_info info = b.request(writable);
  if (info.ndim > 0) {
    // Contiguity check: the engine moves raw bytes.
    ssize_t expect = info.itemsize;
    for (ssize_t i = info.ndim - 1; i >= 0; --i) {
      if (info.shape[i] > 1 && info.strides[i] != expect)
        throw Error(Error::kConfig, std::string(what) + " must be C-contiguous");
      expect *= info.shape[i];
    }
  }
  return {info.ptr, static_cast<size_t>(info.size * info.itemsize)};
}

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// One operation's request; checks that both buffers hold exactly `shape` of `dtype`.
OpRequest MakeRequest(const std::string& name, const std::string& dtype, std::vector<int64_t> shape, Op op,
                      int root, int priority, int participants, const std::string& device,
                      const std::string& layout, const BufferView& in, const BufferView& out) {
  OpRequest r;
  r.participants = participants;
  r.name = name;
  r.dtype = ParseDType(dtype);
  r.shape = std::move(shape);
  r.op = op;
  r.root = root;
  r.priority = priority;
  r.device = device;
  r.layout = layout;
  const size_t want = static_cast<size_t>(Elements(r.shape)) * DTypeSize(r.dtype);
  if (in.nbytes != want || out.nbytes != want)
    throw Error(Error::kConfig, "tensor '" + name + "': buffers must hold " + std::to_string(want) +
                                    " bytes for shape " + ShapeString(r.shape) + " of " + dtype +
                                    ". Received: input=" + std::to_string(in.nbytes) +
                                    " bytes, output=" + std::to_string(out.nbytes) + " bytes");
  r.input = in.ptr;
  r.output = out.ptr;
  return r;
}

// A server handler written in Python (for tests and for prototyping server-side logic;
// it runs under the GIL, so it is slow): `on_push(key, version, dtype, sender, data)`
// gets each push's bytes (a read-only memoryview; None for an empty push) and
// `on_round_complete(key, version, dtype, nbytes, senders)` returns the round's answer,
// a bytes-like object of `nbytes` bytes, or raises to fail the round.
class PythonHandler : public ServerHandler {
 public:
  PythonHandler(py::object impl, std::shared_ptr<BufferPool> pool) : impl_(std::move(impl)), pool_(std::move(pool)) {}
  ~PythonHandler() override {
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }
  std::string OnPush(Round& r, const Push& p) override {
    py::gil_scoped_acquire gil;
    try {
      py::object data = p.body ? py::object(py::memoryview::from_memory(p.body->data(), p.len, true)) : py::none();
      impl_.attr("on_push")(r.key, r.version, DTypeName(p.dtype), p.sender, data);
      return "";
    } catch (const py::error_already_set& e) {
      return std::string("server handler: ") + e.what();
    }
  }
  std::string OnRoundComplete(Round& r) override {
    py::gil_scoped_acquire gil;
    try {
      py::buffer out = impl_.attr("on_round_complete")(r.key, r.version, DTypeName(r.dtype), r.len, r.senders);
      py::buffer_info info = out.request();
      const uint64_t n = static_cast<uint64_t>(info.size * info.itemsize);
      if (n != r.len)
        return "server handler answered " + std::to_string(n) + " bytes for a round of " + std::to_string(r.len);
      r.result = pool_->Acquire(r.len);
      if (n) std::memcpy(r.result->data(), info.ptr, n);
      return "";
    } catch (const py::error_already_set& e) {
      return std::string("server handler: ") + e.what();
    }
  }

 private:
  py::object impl_;
  std::shared_ptr<BufferPool> pool_;
};

template <typename T>
bool WaitReleased(T& obj, double seconds) {
  py::gil_scoped_release nogil;
  return obj.Wait(seconds);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "bpstrain's C++ push_pull engine (scheduler, summation server, worker).";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      TranslateError(e);
    }
  });

  m.def("dtype_size", [](const std::string& d) { return DTypeSize(ParseDType(d)); });
  m.def("set_log_prefix", &SetLogPrefix);
  m.def("resolve_cpus", &ResolveCpuSpec, py::arg("spec"), py::arg("local_rank") = 0,
        "CPU list a NUMA spec resolves to (empty: no pinning).");
  m.def("numa_node_count", &NumaNodeCount);
  m.def(
      "sum_into",
      [](py::buffer dst, py::buffer src, const std::string& dtype) {
        DType t = ParseDType(dtype);
        BufferView d = View(dst, true, "dst"), s = View(src, false, "src");
        if (d.nbytes != s.nbytes) throw Error(Error::kConfig, "sum_into: dst and src sizes differ");
        size_t n = d.nbytes / DTypeSize(t);
        py::gil_scoped_release nogil;
        if (AccumulatesInFloat(t)) {
          std::vector<float> acc(n);
          Widen(t, acc.data(), d.ptr, n);
          Accumulate(t, acc.data(), s.ptr, n);
          Narrow(t, d.ptr, acc.data(), n);
        } else {
          SumInto(t, d.ptr, s.ptr, n);
        }
      },
      py::arg("dst"), py::arg("src"), py::arg("dtype"),
      "dst += src with the servers' kernels (fp16/bf16 through fp32).");

  m.def(
      "accumulate",
      [](py::buffer acc, py::buffer src, const std::string& dtype) {
        DType t = ParseDType(dtype);
        if (!AccumulatesInFloat(t)) throw Error(Error::kConfig, "accumulate is for float16/bfloat16");
        BufferView a = View(acc, true, "acc"), s = View(src, false, "src");
        size_t n = s.nbytes / DTypeSize(t);
        if (a.nbytes != n * sizeof(float)) throw Error(Error::kConfig, "acc must be float32 of src's length");
        py::gil_scoped_release nogil;
        Accumulate(t, static_cast<float*>(a.ptr), s.ptr, n);
      },
      py::arg("acc"), py::arg("src"), py::arg("dtype"),
      "acc (float32) += src (float16/bfloat16): what a server does per push of a half tensor.");

  // The workers' side of compression for CPU tensors: the same C++ codec as the servers',
  // far faster than elementwise torch ops, chunks on several cores.
  m.def(
      "codec_encode",
      [](py::buffer x, py::buffer out, py::object residual, int codec, int flags, int param, uint64_t chunk,
         double ratio, uint64_t seed) {
        BufferView xv = View(x, false, "x"), ov = View(out, true, "out");
        codec::TensorLayout t;
        t.codec = static_cast<uint8_t>(codec);
        t.flags = static_cast<uint8_t>(flags);
        t.param = static_cast<uint16_t>(param);
        t.chunk = chunk;
        t.ratio = ratio;
        const size_t numel = xv.nbytes / sizeof(float);
        if (codec < codec::kOneBit || codec > codec::kDithering || chunk == 0 || chunk > UINT32_MAX ||
            (flags & ~(codec::kFlagScaled | codec::kFlagServerEF)) ||
            (codec == codec::kDithering ? (param < 1 || param > 127) : param != 0) ||
            (codec == codec::kTopK && !(ratio > 0 && ratio <= 1)))
          throw Error(Error::kConfig, "codec_encode: bad codec, flags, parameter, chunk or ratio");
        if (ov.nbytes != codec::EncodedBytes(t, numel))
          throw Error(Error::kConfig, "codec_encode: out must have " + std::to_string(codec::EncodedBytes(t, numel)) +
                                          " bytes. Received: " + std::to_string(ov.nbytes));
        float* res = nullptr;
        if (!residual.is_none()) {
          BufferView rv = View(residual.cast<py::buffer>(), true, "residual");
          if (rv.nbytes != xv.nbytes) throw Error(Error::kConfig, "codec_encode: residual must be x's size");
          res = static_cast<float*>(rv.ptr);
        }
        py::gil_scoped_release nogil;
        codec::EncodeTensor(t, static_cast<const float*>(xv.ptr), numel, static_cast<uint8_t*>(ov.ptr), res, seed);
      },
      py::arg("x"), py::arg("out"), py::arg("residual"), py::arg("codec"), py::arg("flags"), py::arg("param"),
      py::arg("chunk"), py::arg("ratio"), py::arg("seed") = 0,
      "Encodes float32 x as compressed blobs (bpstrain/_codec.py's layout) into out; residual "
      "(or None) receives x minus what the blobs decode to; seed != 0: stochastic dithering.");
  m.def(
      "codec_decode",
      [](py::buffer data, py::object out_obj) {
        BufferView dv = View(data, false, "data");
        const bool check_only = out_obj.is_none();  // a GPU tensor's answer: checked here, decoded there
        BufferView ov = check_only ? BufferView{nullptr, 0} : View(out_obj.cast<py::buffer>(), true, "out");
        const auto* bytes = static_cast<const uint8_t*>(dv.ptr);
        std::vector<codec::BlobHeader> blobs;
        std::string error;
        {
          py::gil_scoped_release nogil;
          error = codec::Parse(bytes, dv.nbytes, &blobs);
          size_t total = 0;
          for (const auto& h : blobs) total += h.n;
          if (error.empty() && !check_only && total * sizeof(float) != ov.nbytes)
            error = "the blobs hold " + std::to_string(total) + " elements, the output " +
                    std::to_string(ov.nbytes / sizeof(float));
          if (error.empty() && !check_only) {
            float* o = static_cast<float*>(ov.ptr);
            for (const auto& h : blobs) {
              codec::DecodeInto(h, bytes, o, true);
              o += h.n;
            }
          }
        }
        if (!error.empty()) throw Error(Error::kPeer, "a compressed answer failed its checks: " + error);
      },
      py::arg("data"), py::arg("out"),
      "Checks compressed blobs (a server's answer) and decodes them into float32 out (None: only "
      "check); raises PeerError naming what is wrong.");

  // The servers' compressed-round code on its own (no network): tests compare it with
  // bpstrain/_codec.py's reference, the compression benchmark times it.
  py::class_<SumHandler>(m, "CompressedRounds")
      .def(py::init([] { return std::make_unique<SumHandler>(BufferPool::Create()); }))
      .def(
          "round",
          [](SumHandler& h, uint64_t key, uint64_t version, const std::vector<py::buffer>& pushes) {
            std::vector<BufferView> views;
            for (const auto& p : pushes) views.push_back(View(p, false, "push"));
            if (views.empty()) throw Error(Error::kConfig, "a round needs at least one push");
            Round r;
            r.key = key;
            r.version = version;
            r.dtype = DType::kCompressed;
            r.len = views[0].nbytes;
            r.expected = static_cast<int>(views.size());
            std::string error;
            {
              py::gil_scoped_release nogil;
              for (size_t i = 0; i < views.size() && error.empty(); ++i) {
                if (views[i].nbytes != r.len) error = "pushes differ in size";
                Push p;
                p.key = key;
                p.version = version;
                p.dtype = DType::kCompressed;
                p.len = r.len;
                p.expected = r.expected;
                p.sender = static_cast<int>(i);
                p.body = std::make_shared<Buffer>(r.len);
                std::memcpy(p.body->data(), views[i].ptr, r.len);
                r.senders.push_back(p.sender);
                ++r.pushes;
                if (error.empty()) error = h.OnPush(r, p);
              }
              if (error.empty()) error = h.OnRoundComplete(r);
            }
            if (!error.empty()) throw Error(Error::kMismatch, error);
            return r.result ? py::bytes(r.result->data(), r.len) : py::bytes();
          },
          py::arg("key"), py::arg("version"), py::arg("pushes"),
          "What a server answers for one round of compressed pushes (rank order); the "
          "error-feedback residual of `key` carries to its next round.");

  m.def("auto_partition_bytes", &AutoPartitionBytes, py::arg("link_bytes_per_s"), py::arg("tensor_bytes"),
        py::arg("num_servers"), py::arg("elem_bytes") = 1,
        "The partition size the scheduler picks when partition_bytes is 0 (auto).");
  m.def(
      "auto_socket_send_buffer",
      [](double link_bytes_per_s, double rtt_s, int peers) {
        LinkEstimate l;
        l.bytes_per_s = link_bytes_per_s;
        l.rtt_s = rtt_s;
        return AutoSocketSendBuffer(l, peers);
      },
      py::arg("link_bytes_per_s"), py::arg("rtt_s"), py::arg("peers") = 4,
      "The data sockets' send buffer when socket_send_buffer is -1 (auto).");
  m.def(
      "mixed_shares",
      [](const std::vector<std::string>& server_hosts, const std::vector<std::string>& worker_hosts, bool mixed) {
        return MixedShares(server_hosts, std::set<std::string>(worker_hosts.begin(), worker_hosts.end()), mixed);
      },
      py::arg("server_hosts"), py::arg("worker_hosts"), py::arg("mixed") = true,
      "Fraction of the bytes each server holds, given each server's and worker's host.");

  py::enum_<Op>(m, "Op", "What one operation does with the ranks' tensors.")
      .value("SUM", Op::kSum)
      .value("AVERAGE", Op::kAverage)
      .value("BROADCAST", Op::kBroadcast);
  py::implicitly_convertible<int, Op>();  // 0/1/2 as before

  // A raw frame link for tests that play a hostile or broken peer over any transport.
  py::class_<Link, std::shared_ptr<Link>>(m, "RawLink", "One frame link opened with connect_raw(); for tests and tools.")
      .def(
          "send",
          [](Link& l, int type, py::bytes meta, py::bytes body, uint64_t key, uint64_t version, int64_t arg,
             int flags, int sender) {
            FrameHeader h;
            h.type = static_cast<uint16_t>(type);
            h.key = key;
            h.version = version;
            h.arg = arg;
            h.flags = static_cast<uint16_t>(flags);
            h.sender = sender;
            std::string m = meta, b = body;
            py::gil_scoped_release nogil;
            l.Send(h, m, b.data(), b.size());
          },
          py::arg("type"), py::arg("meta") = py::bytes(), py::arg("body") = py::bytes(), py::arg("key") = 0,
          py::arg("version") = 0, py::arg("arg") = 0, py::arg("flags") = 0, py::arg("sender") = -1)
      .def(
          "recv",
          [](Link& l, double timeout) -> py::object {
            FrameHeader h;
            std::string meta, body;
            {
              py::gil_scoped_release nogil;
              l.SetRecvTimeout(timeout);
              if (!l.RecvFrame(&h, &meta, kMaxBodyLen)) return py::none();
              body.resize(h.body_len);
              if (h.body_len) l.RecvBody(&body[0], h.body_len);
            }
            return py::make_tuple(h.type, h.key, h.version, h.arg, py::bytes(meta), py::bytes(body));
          },
          py::arg("timeout") = 10.0, "(type, key, version, arg, meta, body) of the next frame; None at the end.")
      .def("shutdown", &Link::Shutdown);
  m.def(
      "check_transport", [](const std::string& name) { Transport::Get(name); }, py::arg("name"),
      "Starts the transport called name (tcp, inproc, ucx, ucx:<UCX_TLS>) or raises ConfigError "
      "saying why it is unavailable (e.g. no UCX in this build or on this machine).");
  m.def(
      "ucx_rules",
      [](unsigned major, unsigned minor, std::optional<std::string> proto_enable,
         std::optional<std::string> rndv_thresh, const std::string& tls) {
        const ucx::ContextRules r = ucx::RulesFor(major, minor, proto_enable ? proto_enable->c_str() : nullptr,
                                                  rndv_thresh ? rndv_thresh->c_str() : nullptr, tls);
        py::dict d;
        d["protocols_v2"] = r.protocols_v2;
        d["eager_bodies"] = r.eager_bodies;
        return d;
      },
      py::arg("major"), py::arg("minor"), py::arg("proto_enable") = py::none(),
      py::arg("rndv_thresh") = py::none(), py::arg("tls") = "tcp",
      "What the ucx transport asks of a UCX major.minor with these UCX_PROTO_ENABLE / "
      "UCX_RNDV_THRESH values (None: unset) and UCX_TLS: {protocols_v2, eager_bodies}.");
  m.def(
      "connect_raw",
      [](const std::string& transport, const std::string& host, int port, double timeout, bool handshake,
         const std::string& secret, py::bytes key, const std::string& identity, bool body_tags) {
        auto t = Transport::Get(transport);
        std::string ep = t->Endpoint(host, port);
        std::string k = key;
        py::gil_scoped_release nogil;
        std::shared_ptr<Link> link = t->Connect(ep, timeout, nullptr);
        if (!handshake) return link;
        return SecureConnect(std::move(link), k.empty() ? ClusterKey(secret) : k, identity, body_tags);
      },
      py::arg("transport"), py::arg("host"), py::arg("port"), py::arg("timeout") = 10.0,
      py::arg("handshake") = false, py::arg("secret") = "", py::arg("key") = py::bytes(),
      py::arg("identity") = "worker", py::arg("body_tags") = true,
      "A RawLink to host:port over `transport` (\"tcp\" or \"inproc\"). With handshake=True it first "
      "runs the secure handshake as `identity`, keyed by `key` (a data credential) or by `secret`'s cluster key; "
      "the link then authenticates every frame.");
  m.def(
      "hmac_sha256", [](py::bytes key, py::bytes msg) { return py::bytes(HmacSha256(key, msg)); },
      py::arg("key"), py::arg("message"), "HMAC-SHA256 as the engine computes it (for tests).");
  m.def(
      "pbkdf2_sha256",
      [](py::bytes password, py::bytes salt, int iterations) {
        return py::bytes(Pbkdf2Sha256(password, salt, iterations));
      },
      py::arg("password"), py::arg("salt"), py::arg("iterations"));
  m.def("sha256_accelerated", &Sha256Accelerated, "True when SHA-256 runs on the CPU's SHA extensions.");
  m.def("poly1305_available", &Poly1305Available, "True when body tags can use Poly1305 (libcrypto.so.3).");
  m.def(
      "poly1305", [](py::bytes key, py::bytes msg) {
        std::string m = msg;
        return py::bytes(Poly1305(key, m.data(), m.size()));
      },
      py::arg("key"), py::arg("message"), "Poly1305 as the engine computes body tags (for tests).");
  m.def(
      "link_body_auth",
      [](const std::shared_ptr<Link>& l) {
        auto* s = dynamic_cast<SecureLink*>(l.get());
        return std::string(s ? BodyAuthName(s->body_auth()) : "unauthenticated");
      },
      py::arg("link"), "How a RawLink from connect_raw(handshake=True) tags bodies.");

  py::class_<SendPolicy>(m, "SendPolicy",
                         "The worker's partition scheduling policy (priority, credit, global order, spread), "
                         "exposed for tests; parts are (offset, bytes, server).")
      .def(py::init<int, bool, int64_t>(), py::arg("num_servers"), py::arg("priority"), py::arg("credit_bytes"))
      .def(
          "add_op",
          [](SendPolicy& p, uint64_t key_base, uint64_t version, int priority,
             const std::vector<std::tuple<int64_t, int64_t, int>>& parts, int rank) {
            std::vector<Part> ps;
            for (const auto& [off, len, server] : parts) {
              if (server < 0 || len < 0) throw Error(Error::kConfig, "bad part");
              ps.push_back(Part{off, len, server});
            }
            p.AddOp(nullptr, key_base, version, priority, ps, rank);
          },
          py::arg("key_base"), py::arg("version"), py::arg("priority"), py::arg("parts"), py::arg("rank"))
      .def("ready", &SendPolicy::Ready, py::arg("server"))
      .def(
          "pop",
          [](SendPolicy& p, int server) {
            if (!p.Ready(server)) throw Error(Error::kConfig, "server " + std::to_string(server) + " is not ready");
            SendTask t = p.Pop(server);
            return py::make_tuple(t.key, t.version, t.offset, t.len, t.server, t.priority);
          },
          py::arg("server"), "(key, version, offset, bytes, server, priority) of the next push; charges the credit.")
      .def("done", &SendPolicy::Done, py::arg("bytes"))
      .def_property_readonly("bytes_in_flight", &SendPolicy::bytes_in_flight)
      .def_static("spread_order", &SendPolicy::SpreadOrder, py::arg("servers"), py::arg("rank"),
                  py::arg("num_servers"));

  py::class_<Scheduler>(m, "Scheduler")
      .def(py::init([](int workers, int servers, const std::string& host, int port,
                       double rendezvous_timeout, double peer_timeout, const std::string& secret,
                       int local_size, bool mixed_mode, const std::string& transport, bool fault_tolerance,
                       int max_workers) {
             SchedulerOptions o;
             o.fault_tolerance = fault_tolerance;
             o.max_workers = max_workers;
             o.transport = transport;
             o.num_workers = workers;
             o.local_size = local_size;
             o.mixed_mode = mixed_mode;
             o.num_servers = servers;
             o.host = host;
             o.port = port;
             o.rendezvous_timeout = rendezvous_timeout;
             o.peer_timeout = peer_timeout;
             o.secret = secret;
             return std::make_unique<Scheduler>(o);
           }),
           py::arg("num_workers"), py::arg("num_servers"), py::arg("host") = "127.0.0.1",
           py::arg("port") = 0, py::arg("rendezvous_timeout") = 120.0,
           py::arg("peer_timeout") = 30.0, py::arg("secret") = "", py::arg("local_size") = 0,
           py::arg("mixed_mode") = true, py::arg("transport") = "tcp", py::arg("fault_tolerance") = false,
           py::arg("max_workers") = 0)
      .def_property_readonly("port", &Scheduler::port)
      .def("stats",
           [](Scheduler& s) {
             Scheduler::Stats st = s.stats();
             py::dict d;
             d["threads"] = st.threads;
             d["refused"] = st.refused;
             d["nodes"] = st.nodes;
             return d;
           })
      .def("start", &Scheduler::Start)
      .def("wait", &WaitReleased<Scheduler>, py::arg("seconds"))
      .def("stop", &Scheduler::Stop, py::call_guard<py::gil_scoped_release>());

  py::class_<Server>(m, "Server")
      .def(py::init([](const std::string& scheduler_host, int scheduler_port,
                       const std::string& listen_host, const std::string& advertise_host, int server_id,
                       int engine_threads, const std::string& numa, double rendezvous_timeout,
                       const std::string& secret, const std::string& host_id, const std::string& transport,
                       py::object handler, double round_timeout, bool authenticate_bodies) {
             ServerOptions o;
             o.round_timeout = round_timeout;
             o.authenticate_bodies = authenticate_bodies;
             o.transport = transport;
             if (!handler.is_none()) {
               // One Python handler object per engine thread, made by calling `handler()`.
               o.handler = [handler](std::shared_ptr<BufferPool> pool) -> std::unique_ptr<ServerHandler> {
                 py::gil_scoped_acquire gil;
                 return std::make_unique<PythonHandler>(handler(), std::move(pool));
               };
             }
             o.host_id = host_id;
             o.scheduler_host = scheduler_host;
             o.scheduler_port = scheduler_port;
             o.listen_host = listen_host;
             o.advertise_host = advertise_host;
             o.server_id = server_id;
             o.engine_threads = engine_threads;
             o.numa = numa;
             o.rendezvous_timeout = rendezvous_timeout;
             o.secret = secret;
             return std::make_unique<Server>(o);
           }),
           py::arg("scheduler_host"), py::arg("scheduler_port"), py::arg("listen_host") = "",
           py::arg("advertise_host") = "", py::arg("server_id") = -1, py::arg("engine_threads") = 2,
           py::arg("numa") = "auto", py::arg("rendezvous_timeout") = 120.0, py::arg("secret") = "",
           py::arg("host_id") = "", py::arg("transport") = "tcp", py::arg("handler") = py::none(),
           py::arg("round_timeout") = 300.0, py::arg("authenticate_bodies") = true,
           "`handler`: None (sum) or a factory of Python server handlers (see PythonHandler). `listen_host`: "
           "\"\" = the advertised host, else this host's address toward the scheduler; \"0.0.0.0\" = all.")
      .def_property_readonly("port", &Server::port)
      .def_property_readonly("endpoint", &Server::endpoint)
      .def("stats",
           [](Server& s) {
             Server::Stats st = s.stats();
             py::dict d;
             d["pending_rounds"] = st.pending_rounds;
             d["connections"] = st.connections;
             d["threads"] = st.threads;
             d["expired_rounds"] = st.expired_rounds;
             return d;
           })
      .def("start", &Server::Start)
      .def("wait", &WaitReleased<Server>, py::arg("seconds"))
      .def("stop", &Server::Stop, py::call_guard<py::gil_scoped_release>());

  py::class_<Worker>(m, "Worker")
      .def(py::init([](const std::string& scheduler_host, int scheduler_port, int64_t rank_hint,
                       int local_rank, int local_size, int64_t partition_bytes, int64_t credit_bytes,
                       int connections_per_server, bool priority, const std::string& numa,
                       double rendezvous_timeout, const std::string& secret, int hierarchical,
                       int socket_send_buffer, const std::string& advertise_host, const std::string& host_id,
                       const std::string& transport, bool authenticate_bodies, int aggregate,
                       const std::string& consistency, bool staleness_lr, bool fault_tolerance) {
             WorkerOptions o;
             o.fault_tolerance = fault_tolerance;
             o.aggregate = aggregate;
             o.consistency = consistency;
             o.staleness_lr = staleness_lr;
             o.transport = transport;
             o.authenticate_bodies = authenticate_bodies;
             o.advertise_host = advertise_host;
             o.host_id = host_id;
             o.hierarchical = hierarchical;
             o.socket_send_buffer = socket_send_buffer;
             o.scheduler_host = scheduler_host;
             o.scheduler_port = scheduler_port;
             o.rank_hint = rank_hint;
             o.local_rank = local_rank;
             o.local_size = local_size;
             o.partition_bytes = partition_bytes;
             o.credit_bytes = credit_bytes;
             o.connections_per_server = connections_per_server;
             o.priority = priority;
             o.numa = numa;
             o.rendezvous_timeout = rendezvous_timeout;
             o.secret = secret;
             return std::make_unique<Worker>(o);
           }),
           py::arg("scheduler_host"), py::arg("scheduler_port"), py::arg("rank_hint") = -1,
           py::arg("local_rank") = 0, py::arg("local_size") = 1, py::arg("partition_bytes") = 0,
           py::arg("credit_bytes") = 0, py::arg("connections_per_server") = 1, py::arg("priority") = true,
           py::arg("numa") = "auto", py::arg("rendezvous_timeout") = 120.0, py::arg("secret") = "",
           py::arg("hierarchical") = static_cast<int>(WorkerOptions::kAuto), py::arg("socket_send_buffer") = -1,
           py::arg("advertise_host") = "", py::arg("host_id") = "", py::arg("transport") = "tcp",
           py::arg("authenticate_bodies") = true, py::arg("aggregate") = 0, py::arg("consistency") = "sync",
           py::arg("staleness_lr") = false, py::arg("fault_tolerance") = false)
      .def("start", &Worker::Start)
      .def(
          "membership",
          [](Worker& w) {
            Membership m = w.membership();
            py::dict d;
            d["epoch"] = m.epoch;
            d["departed"] = m.departed;
            d["live_rank"] = m.live_rank;
            d["live_size"] = m.live_size;
            d["answered_epoch"] = m.answered_epoch;
            d["answered_departed"] = m.answered_departed;
            d["scheduler_lost"] = m.scheduler_lost;
            d["joined"] = m.joined;
            d["admitted_late"] = m.admitted_late;
            d["lost_servers"] = m.lost_servers;
            return d;
          },
          "Fault tolerance: {'epoch', 'departed' (rendezvous ranks that left), 'live_rank', 'live_size', "
          "'answered_epoch', 'answered_departed' (the membership the answers received so far were computed "
          "under: the same on every rank between two steps), 'scheduler_lost' (the job goes on without its "
          "scheduler), 'joined' (ranks that joined at the newest admission), 'admitted_late' (this worker "
          "joined the running job), 'lost_servers' (servers that died or hung; their partitions moved)}.")
      .def("wait_ready", &Worker::WaitReady, py::arg("seconds"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &Worker::rank)
      .def_property_readonly("size", &Worker::size)
      .def_property_readonly("num_servers", &Worker::num_servers)
      .def_property_readonly("link_bytes_per_s", [](Worker& w) { return w.link().bytes_per_s; },
                             "Link rate measured at rendezvous (0 when partitions and credit were set).")
      .def_property_readonly("link_rtt_s", [](Worker& w) { return w.link().rtt_s; })
      .def_property_readonly("credit_bytes", &Worker::credit_bytes)
      .def_property_readonly("hierarchical", &Worker::hierarchical,
                             "True when this worker reduces through its host's shared memory.")
      .def(
          "declare",
          [](Worker& w, const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
             const std::string& device, const std::string& layout) {
            OpRequest r;
            r.name = name;
            r.dtype = ParseDType(dtype);
            r.shape = std::move(shape);
            r.device = device;
            r.layout = layout;
            py::gil_scoped_release nogil;
            w.Declare(r);
          },
          py::arg("name"), py::arg("dtype"), py::arg("shape"), py::arg("device") = "cpu", py::arg("layout") = "",
          "Declares `name` now (ops declare on first use). A later use with another dtype, shape,\n"
          "device or layout declares it afresh, checked across ranks like the first.")
      .def(
          "enqueue",
          [](Worker& w, const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
             py::buffer input, py::buffer output, Op op, int root, int priority, int participants,
             const std::string& device, const std::string& layout, int64_t partition_bytes, bool pull_only,
             int param, double lr, const std::string& server_optimizer, bool keep_own) {
            BufferView in = View(input, false, "input"), out = View(output, true, "output");
            OpRequest r = MakeRequest(name, dtype, std::move(shape), op, root, priority, participants, device,
                                      layout, in, out);
            if (partition_bytes < 0)
              throw Error(Error::kConfig, "partition_bytes must be >= 0. Received: " + std::to_string(partition_bytes));
            r.partition_bytes = partition_bytes;
            r.pull_only = pull_only;
            r.keep_own = keep_own;
            r.param = param;
            r.lr = lr;
            r.server_optimizer = server_optimizer;
            py::gil_scoped_release nogil;
            return w.Enqueue(r);
          },
          py::arg("name"), py::arg("dtype"), py::arg("shape"), py::arg("input"), py::arg("output"),
          py::arg("op"), py::arg("root") = 0, py::arg("priority") = 0, py::arg("participants") = 0,
          py::arg("device") = "cpu", py::arg("layout") = "", py::arg("partition_bytes") = 0,
          py::arg("pull_only") = false, py::arg("param") = 0, py::arg("lr") = 0.0,
          py::arg("server_optimizer") = "", py::arg("keep_own") = false,
          "Queues one operation (`op`: Op.SUM, Op.AVERAGE or Op.BROADCAST); returns its handle.\n"
          "`device` and `layout` are compared across ranks with the shape and dtype;\n"
          "`partition_bytes` > 0 overrides the worker's partition size for this tensor; `pull_only`\n"
          "(k-of-n catch-up) takes an answered round's result without contributing (input unread).\n"
          "`param` (comm.consistency ssp/async): 1 = init, a broadcast the servers keep as the weights\n"
          "and step with `server_optimizer` ('sgd momentum=0.9', 'adam eps=1e-8', ...); 2 = update, an\n"
          "Op.SUM push of the gradient answered with the weights, `lr` the step's learning rate.\n"
          "`keep_own` (broadcasts): this worker holds the result already; it takes part in the round\n"
          "but receives no bytes, and `output` gets its own `input`.")
      .def(
          "enqueue_at",
          [](Worker& w, const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
             uintptr_t input, uintptr_t output, size_t nbytes, Op op, int priority, int param, double lr,
             const std::string& server_optimizer) {
            // For adapters whose tensors are not buffer objects (torch): the caller vouches
            // that both addresses hold `nbytes` of C-contiguous memory and keeps them alive
            // until the operation is over (bpstrain.engine.submit_at does both).
            if (input == 0 || output == 0) throw Error(Error::kConfig, "tensor '" + name + "': a null address");
            OpRequest r = MakeRequest(name, dtype, std::move(shape), op, 0, priority, 0, "cpu", "",
                                      {reinterpret_cast<void*>(input), nbytes},
                                      {reinterpret_cast<void*>(output), nbytes});
            r.param = param;
            r.lr = lr;
            r.server_optimizer = server_optimizer;
            py::gil_scoped_release nogil;
            return w.Enqueue(r);
          },
          py::arg("name"), py::arg("dtype"), py::arg("shape"), py::arg("input"), py::arg("output"),
          py::arg("nbytes"), py::arg("op"), py::arg("priority") = 0, py::arg("param") = 0, py::arg("lr") = 0.0,
          py::arg("server_optimizer") = "",
          "Like `enqueue` with the buffers given as addresses of `nbytes` each (CPU memory the\n"
          "caller keeps alive until the operation is over).")
      .def(
          "enqueue_sparse",
          [](Worker& w, const std::string& name, uint32_t row_width, py::buffer data, int priority, int param,
             double lr, const std::string& table, int64_t after) {
            BufferView in = View(data, false, "data");
            OpRequest r;
            r.name = name;
            r.dtype = DType::kFloat32;
            r.shape = {static_cast<int64_t>(row_width)};
            r.op = Op::kSum;
            r.priority = priority;
            r.layout = "sparse-rows";
            r.partition_bytes = std::max<int64_t>(4 * static_cast<int64_t>(row_width), 1);  // one partition
            r.sparse_row_width = row_width;
            r.sparse_bytes = in.nbytes;
            r.input = in.ptr;
            r.param = param;
            r.lr = lr;
            r.server_optimizer = table;
            r.table_after = after;
            if (row_width == 0) throw Error(Error::kConfig, "tensor '" + name + "': row_width must be >= 1");
            py::gil_scoped_release nogil;
            return w.Enqueue(r);
          },
          py::arg("name"), py::arg("row_width"), py::arg("data"), py::arg("priority") = 0, py::arg("param") = 0,
          py::arg("lr") = 0.0, py::arg("table") = "", py::arg("after") = -1,
          "Row-sparse push_pull: `data` is int64 ids (ascending, unique) then their float32 rows\n"
          "of `row_width`; it must stay alive until the handle is done. take_sparse_result gives the\n"
          "merged rows of every worker (ids then summed rows). `param` 4: a pull of the rows of the\n"
          "ids in `data` from the servers' embedding table `table` (spec, row_table.h); 5: a push of\n"
          "(ids, gradient rows) that the servers average over workers and apply with `lr`. A pull\n"
          "with `after` >= 0 is a prefetch of the rows as of after that many pushes (wire.h): its\n"
          "answer and the answer of push `after` are (ids, rows) of some of the ids.")
      .def(
          "take_sparse_result",
          [](Worker& w, int64_t handle) { return py::bytes(w.TakeSparseResult(handle)); },
          py::arg("handle"), "The merged rows of a finished enqueue_sparse (once).")
      .def("enqueue_barrier", &Worker::EnqueueBarrier, py::call_guard<py::gil_scoped_release>())
      .def("enqueue_admission", &Worker::EnqueueAdmission, py::call_guard<py::gil_scoped_release>(),
           "Fault tolerance: an admission between steps; workers waiting to join the running job join here.")
      .def("poll", &Worker::Poll, py::arg("handle"))
      .def("wait", &Worker::WaitFor, py::arg("handle"), py::arg("seconds"),
           py::call_guard<py::gil_scoped_release>())
      .def("describe", &Worker::Describe, py::arg("handle"))
      .def("rounds_behind", &Worker::RoundsBehind, py::arg("name"),
           "k-of-n: rounds of `name` the servers answered that this worker has not started;\n"
           "enqueue(..., pull_only=True) that many times to take their results without computing.")
      .def("partitions", &Worker::Partitions, py::arg("name"),
           "(offset, bytes, server) of each partition of a placed tensor; [] before that.")
      .def("stats",
           [](Worker& w) {
             WorkerStats s = w.stats();
             py::dict d;
             d["bytes_pushed"] = s.bytes_pushed;
             d["bytes_pulled"] = s.bytes_pulled;
             d["partitions"] = s.partitions;
             d["late_partitions"] = s.late_partitions;
             d["weight_answers"] = s.weight_answers;
             d["max_staleness"] = s.max_staleness;
             // The link measured at rendezvous (0 when not measured): adapters that weigh
             // compute against wire time (compression's auto mode) read it here.
             d["link_bytes_per_s"] = w.link().bytes_per_s;
             d["link_rtt_s"] = w.link().rtt_s;
             return d;
           })
      .def("set_trace", &Worker::SetTrace, py::arg("on"),
           "Records push/pull phase times of every finished operation while on.")
      .def("drain_trace",
           [](Worker& w) {
             py::list out;
             for (const TraceRecord& r : w.DrainTrace()) {
               py::dict d;
               d["name"] = r.name;
               d["op"] = r.op == 2 ? "broadcast" : "push_pull";
               d["version"] = r.version;
               d["bytes"] = r.bytes;
               d["enqueued_us"] = r.enqueued_us;
               d["push_begin_us"] = r.push_begin_us;
               d["push_end_us"] = r.push_end_us;
               d["pull_begin_us"] = r.pull_begin_us;
               d["done_us"] = r.done_us;
               out.append(d);
             }
             return out;
           },
           "Returns and forgets the trace records collected so far.")
      .def("shutdown", &Worker::Shutdown, py::arg("reason") = "", py::call_guard<py::gil_scoped_release>(),
           "Leaves the job; a non-empty `reason` (why this process stops) fails the job for\n"
           "every other node at once, naming this worker and the reason.");
}
