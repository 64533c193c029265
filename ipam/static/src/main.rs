fn main() {
    rcni_cni::skel::run(&r#static::Static)
}
