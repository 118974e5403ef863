//! Where a device sits on the host: the NUMA node of its PCI address (from sysfs).

/// The NUMA node of the PCI device `bus_id` (as the driver names it, e.g. `0000:3B:00.0` or
/// `00000000:3b:00.0`), from `/sys/bus/pci/devices/<id>/numa_node`; `None` when the system does
/// not say (no such file, or -1).
pub(crate) fn pci_numa_node(bus_id: &str) -> Option<u32> {
    let id = sysfs_pci_id(bus_id)?;
    let s = std::fs::read_to_string(format!("/sys/bus/pci/devices/{id}/numa_node")).ok()?;
    s.trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

/// sysfs's spelling of a PCI address: lower case, a 4-digit domain; `None` for anything that is
/// not `domain:bus:device.function` in hex (nothing else reaches the file system).
fn sysfs_pci_id(bus_id: &str) -> Option<String> {
    let (domain, rest) = bus_id.trim().split_once(':')?;
    let (bus, devfn) = rest.split_once(':')?;
    let (dev, func) = devfn.split_once('.')?;
    let hex = |s: &str, max: usize| {
        !s.is_empty() && s.len() <= max && s.chars().all(|c| c.is_ascii_hexdigit())
    };
    if !(hex(domain, 8) && hex(bus, 2) && hex(dev, 2) && hex(func, 1)) {
        return None;
    }
    let domain = u32::from_str_radix(domain, 16).ok()?;
    Some(format!(
        "{domain:04x}:{}:{}.{}",
        bus.to_ascii_lowercase(),
        dev.to_ascii_lowercase(),
        func.to_ascii_lowercase()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_addresses_are_spelled_as_sysfs_does_and_nothing_else_passes() {
        assert_eq!(
            sysfs_pci_id("0000:3B:00.0").as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(
            sysfs_pci_id("00000000:3b:00.0").as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(
            sysfs_pci_id("0001:C1:1F.7").as_deref(),
            Some("0001:c1:1f.7")
        );
        for bad in [
            "",
            "3b:00.0",
            "0000:3b:00",
            "../../etc:00:00.0",
            "0000:3b:00.0/x",
            "0000:3bb:00.0",
        ] {
            assert_eq!(sysfs_pci_id(bad), None, "{bad:?}");
        }
        assert_eq!(pci_numa_node("ffff:ff:1f.7"), None, "no such device");
    }
}
