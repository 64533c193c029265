fn main() {
    rcni_cni::skel::run(&vpc_ipam::VpcIpam)
}
