//! The Rust API with a DLPack tensor: a stager writes padded values into a device tensor
//! described by a `DLTensor`, then `copy_d2h` reads it back into pinned memory, every element
//! checked. Without a GPU it says so and runs the same code on a host tensor.
//!
//! `cargo run --release --example dlpack_stage`

use dlpark::ffi::{DLDataType, DLDataTypeCode, DLDevice, DLTensor};
use pinstage::testing::DeviceBuffer;
use pinstage::{DeviceView, H2DMirror, PinnedStager, StreamHandle};

fn describe(data: *mut std::ffi::c_void, device: DLDevice, shape: &mut [i64]) -> DLTensor {
    DLTensor {
        data,
        device,
        ndim: shape.len() as i32,
        dtype: DLDataType {
            code: DLDataTypeCode::INT,
            bits: 32,
            lanes: 1,
        },
        shape: shape.as_mut_ptr(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

fn main() -> pinstage::Result<()> {
    let stager = PinnedStager::<i32>::builder().numel(256).depth(8).build()?;
    let values: Vec<i32> = (1..=100).collect();
    let mut shape = [8i64, 64];
    let mut mirror = H2DMirror::new();
    match pinstage::Device::new(0) {
        Ok(device) => {
            println!("GPU found: staging into a device tensor described by DLPack");
            let buf = DeviceBuffer::new(&device, 8 * 64 * 4)?;
            let t = describe(buf.ptr() as *mut _, DLDevice::cuda(0), &mut shape);
            // SAFETY: `t` describes `buf`, which outlives the view.
            let view = unsafe { DeviceView::from_dltensor(&t, false) }?;
            let outcome = stager.to(&view).pad(-1).mirror(&mut mirror).copy(&values)?;
            let again = stager.to(&view).pad(-1).mirror(&mut mirror).copy(&values)?;
            println!("first copy: {outcome:?}; same values again: {again:?}");
            let mut pinned = pinstage::PinnedBuffer::new(
                &device,
                view.nbytes(),
                pinstage::host::PinnedFlags::PORTABLE,
            )?;
            let path = pinstage::copy_d2h(&view, pinned.as_mut_slice(), StreamHandle::LEGACY)?;
            let got: &[i32] = pinned.typed()?;
            assert_eq!(&got[..100], &values[..]);
            assert!(got[100..].iter().all(|&x| x == -1));
            println!(
                "copy_d2h via {path:?}: all {} elements checked; stats {:?}",
                got.len(),
                stager.stats()
            );
        }
        Err(e) => {
            println!("no GPU ({e}); the same calls on a host tensor:");
            let mut host = vec![7i32; 8 * 64];
            let t = describe(host.as_mut_ptr().cast(), DLDevice::CPU, &mut shape);
            // SAFETY: `t` describes `host`, which outlives the view.
            let view = unsafe { DeviceView::from_dltensor(&t, false) }?;
            stager.to(&view).pad(-1).mirror(&mut mirror).copy(&values)?;
            assert_eq!(&host[..100], &values[..]);
            assert!(host[100..].iter().all(|&x| x == -1));
            println!(
                "host tensor written directly: all {} elements checked",
                host.len()
            );
        }
    }
    Ok(())
}
