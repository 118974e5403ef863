//! The slot-check and copy-entry-point experiment (`scripts/gpu-run costs`): copy entry points
//! by size, slot-check variants written out against the driver, the stager's calls added one at
//! a time, and the stager itself; ns per call in 3 rounds. Prints a skip line without a GPU.

fn main() {
    if let Err(e) = pinstage::Device::new(0) {
        eprintln!("SKIP slot_check_costs: no GPU ({e})");
        return;
    }
    match pinstage::lab::slot_check_costs(20_000, 3) {
        Ok(rows) => {
            println!("slot check and copy entry points, ns per call, 3 rounds:");
            for (name, ns) in rows {
                let cols: Vec<String> = ns.iter().map(|x| format!("{x:>7.0}")).collect();
                println!("  {name:<52} {}", cols.join(" "));
            }
        }
        Err(e) => {
            println!("slot_check_costs failed: {e}");
            std::process::exit(1);
        }
    }
}
