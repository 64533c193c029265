fn main() {
    rcni_cni::skel::run(&tuning::Tuning)
}
