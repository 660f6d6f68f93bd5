//! Generated gRPC code for Strata's three services, and the codec it is generated with
//! ([`codec`]). Nothing else lives here.

pub mod codec;

pub mod inference {
    pub mod v1 {
        tonic::include_proto!("strata.inference.v1");
    }
}

pub mod admin {
    pub mod v1 {
        tonic::include_proto!("strata.admin.v1");
    }
}

pub mod worker {
    pub mod v1 {
        tonic::include_proto!("strata.worker.v1");
    }
}

/// Encoded `FileDescriptorSet` of every Strata .proto, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/strata_descriptor.bin"));
