//! A Rust consumer of the installed C API (extern "C", no crates): writes a one-step dump of a tiny llama config
//! (embd only), reads it back with the reader and checks the values. Usage: diffrun-consumer OUT.h5
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr;

#[repr(C)]
struct Dump {
    _private: [u8; 0],
}
#[repr(C)]
struct Reader {
    _private: [u8; 0],
}

#[link(name = "diffrun-dump-writer")]
extern "C" {
    fn diffrun_dump_open(path: *const c_char, out: *mut *mut Dump) -> c_int;
    fn diffrun_dump_set_string(d: *mut Dump, name: *const c_char, value: *const c_char) -> c_int;
    fn diffrun_dump_set_int(d: *mut Dump, name: *const c_char, value: i32) -> c_int;
    fn diffrun_dump_set_real(d: *mut Dump, name: *const c_char, value: f64) -> c_int;
    fn diffrun_dump_set_bool(d: *mut Dump, name: *const c_char, value: c_int) -> c_int;
    fn diffrun_dump_set_ids(d: *mut Dump, name: *const c_char, ids: *const i32, n: usize) -> c_int;
    fn diffrun_dump_step(d: *mut Dump, step: c_int) -> c_int;
    fn diffrun_dump_put(d: *mut Dump, name: *const c_char, layer: c_int, dims: *const i64, ndim: c_int, dtype: i32,
                        data: *const c_void) -> c_int;
    fn diffrun_dump_close(d: *mut Dump) -> c_int;
    fn diffrun_dump_last_error(d: *const Dump) -> *const c_char;
    fn diffrun_dump_reader_open(path: *const c_char, out: *mut *mut Reader) -> c_int;
    fn diffrun_dump_reader_get(r: *mut Reader, name: *const c_char, step: c_int, data: *mut *const f32,
                               dims: *mut *const i64, ndim: *mut c_int, row_offset: *mut i64) -> c_int;
    fn diffrun_dump_reader_close(r: *mut Reader) -> c_int;
    fn diffrun_dump_reader_last_error(r: *const Reader) -> *const c_char;
}

const F32: i32 = 0;
const I32: i32 = 4;

fn c(s: &str) -> CString {
    CString::new(s).unwrap()
}

fn text(p: *const c_char) -> String {
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn main() {
    let path = std::env::args().nth(1).expect("usage: diffrun-consumer OUT.h5");
    let ids = [1i32, 2];
    let embd: Vec<f32> = (0..16).map(|i| i as f32).collect();
    let mut d: *mut Dump = ptr::null_mut();
    unsafe {
        if diffrun_dump_open(c(&path).as_ptr(), &mut d) != 0 {
            panic!("open: {}", text(diffrun_dump_last_error(ptr::null())));
        }
        let check = |rc: c_int, what: &str| {
            if rc != 0 {
                panic!("{what}: {}", text(diffrun_dump_last_error(d)));
            }
        };
        for (k, v) in [("backend", "rust-consumer"), ("precision", "f32"), ("model_path", "none.gguf"),
                       ("model_fingerprint", "0:0000000000000000"), ("arch", "llama"), ("rope_type", "norm"),
                       ("prompt", "1,2")] {
            check(diffrun_dump_set_string(d, c(k).as_ptr(), c(v).as_ptr()), k);
        }
        for (k, v) in [("n_layer", 1), ("n_embd", 8), ("n_head", 2), ("n_head_kv", 2), ("head_dim", 4), ("n_ff", 16),
                       ("n_vocab", 10), ("n_ctx", 32)] {
            check(diffrun_dump_set_int(d, c(k).as_ptr(), v), k);
        }
        check(diffrun_dump_set_real(d, c("rope_theta").as_ptr(), 10000.0), "rope_theta");
        check(diffrun_dump_set_real(d, c("rms_eps").as_ptr(), 1e-5), "rms_eps");
        for k in ["tied_output", "qkv_bias", "qk_norm"] {
            check(diffrun_dump_set_bool(d, c(k).as_ptr(), 0), k);
        }
        check(diffrun_dump_set_ids(d, c("token_ids").as_ptr(), ids.as_ptr(), ids.len()), "token_ids");
        check(diffrun_dump_step(d, 0), "step 0");
        let t = [2i64];
        let td = [2i64, 8];
        check(diffrun_dump_put(d, c("tokens").as_ptr(), -1, t.as_ptr(), 1, I32, ids.as_ptr().cast()), "tokens");
        check(diffrun_dump_put(d, c("embd").as_ptr(), -1, td.as_ptr(), 2, F32, embd.as_ptr().cast()), "embd");
        if diffrun_dump_close(d) != 0 {
            panic!("close: {}", text(diffrun_dump_last_error(ptr::null())));
        }

        let mut r: *mut Reader = ptr::null_mut();
        if diffrun_dump_reader_open(c(&path).as_ptr(), &mut r) != 0 {
            panic!("reader: {}", text(diffrun_dump_reader_last_error(ptr::null())));
        }
        let (mut x, mut dims, mut ndim, mut row_offset) = (ptr::null(), ptr::null(), 0, -1i64);
        if diffrun_dump_reader_get(r, c("embd").as_ptr(), 0, &mut x, &mut dims, &mut ndim, &mut row_offset) != 0 {
            panic!("get: {}", text(diffrun_dump_reader_last_error(r)));
        }
        let shape = std::slice::from_raw_parts(dims, ndim as usize).to_vec();
        let values = std::slice::from_raw_parts(x, 16).to_vec();
        diffrun_dump_reader_close(r);
        assert_eq!((shape, row_offset), (vec![2, 8], 0));
        assert_eq!(values, embd);
    }
    println!("diffrun-consumer (Rust): wrote and read back {path}");
}
